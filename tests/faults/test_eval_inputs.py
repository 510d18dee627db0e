"""`hacrl eval` on damaged or incomplete HF folders and on bad arguments: exit 2 with one line naming
the file or the flag, before any model loads (the checks `hacrl convert` has)."""

from __future__ import annotations

import shutil

import pytest
import torch

from hacrl_megatron.cli import main
from hacrl_megatron.exchange import load_tokenizer
from tests.unit.test_rollout_hf import tiny_llama

torch.set_num_threads(1)
RUN = ["--benchmarks", "addition", "--limit", "2", "--max-new-tokens", "2", "--template", "plain"]


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_inputs")
    tok = load_tokenizer("char", root / "tok")
    tiny_llama(len(tok)).save_pretrained(root / "good")
    tok.save_pretrained(root / "good")
    return root / "good"


def _damaged(agent, tmp_path, name, how):
    folder = tmp_path / "agent"
    shutil.copytree(agent, folder)
    path = folder / name
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    else:
        path.write_bytes(b"\x00garbage\xff" * 10)
    return folder, path


def _line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("hacrl")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("name, how, expected", [
    ("tokenizer.json", "truncated", "{path}: tokenizer.json is not valid JSON ("),
    ("tokenizer.json", "garbage", "{path}: tokenizer.json is not UTF-8 text ("),
    ("config.json", "truncated", "{path}: config.json is not valid JSON ("),
    ("config.json", "garbage", "{path}: config.json is not UTF-8 text ("),
    ("model.safetensors", "truncated", "{path}: not a readable safetensors file ("),
    ("model.safetensors", "garbage", "{path}: not a readable safetensors file ("),
    ("tokenizer.json", "missing", "--agent {folder}: no tokenizer (tokenizer.json, tokenizer.model, vocab.json all "
                                  "missing); save the tokenizer next to the weights"),
    ("model.safetensors", "missing", "--agent {folder}: no weights (no *.safetensors"),
    ("config.json", "missing", "--agent {folder}: not an HF model folder (no config.json)"),
])
def test_a_damaged_or_incomplete_agent_folder_is_named(agent, tmp_path, capsys, name, how, expected):
    folder, path = _damaged(agent, tmp_path, name, how)
    assert main(["eval", "--agent", str(folder), *RUN]) == 2
    assert _line(capsys).startswith("hacrl: " + expected.format(path=path, folder=folder))


def test_a_tokenizer_json_that_is_json_but_no_tokenizer_is_named(agent, tmp_path, capsys):
    folder, path = _damaged(agent, tmp_path, "tokenizer.json", "missing")
    path.write_text('{"version": "1.0", "model": {"type": "nonsense"}}')
    assert main(["eval", "--agent", str(folder), *RUN]) == 2
    assert _line(capsys).startswith(f"hacrl: --agent {folder}: the tokenizer cannot be loaded (")


@pytest.mark.parametrize("flag, value, expected", [
    ("--limit", "-3", "--limit=-3: must be >= 1"),
    ("--k", "0", "--k=0: must be >= 1"),
    ("--max-new-tokens", "-1", "--max-new-tokens=-1: must lie in [1, 1048576]"),
    ("--temperature", "-1", "--temperature=-1.0: must be a finite number > 0"),
    ("--temperature", "nan", "--temperature=nan: must be a finite number > 0"),
    ("--verifier-workers", "-1", "--verifier-workers=-1: must lie in [0, 256]"),
    ("--dtype", "int8", "--dtype='int8': must be one of ['float32', 'bfloat16', 'float16']"),
])
def test_bad_arguments_are_refused_before_any_model_loads(agent, capsys, flag, value, expected):
    args = list(RUN)
    if flag in args:  # replace the default run's value of this flag
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    assert main(["eval", "--agent", str(agent), *args]) == 2
    assert _line(capsys).startswith(f"hacrl: {expected}")


def test_out_an_existing_file_or_a_runs_own_folder_is_refused(agent, tmp_path, capsys):
    (tmp_path / "results").write_text("not a folder")
    assert main(["eval", "--agent", str(agent), *RUN, "--out", str(tmp_path / "results")]) == 2
    assert _line(capsys) == f"hacrl: --out {tmp_path / 'results'}: {tmp_path / 'results'} is a file, not a folder"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text('{"role": "output", "run_id": "x", "config": {}}')
    assert main(["eval", "--agent", str(agent), *RUN, "--out", str(tmp_path / "run" / "final")]) == 2
    assert "is written by the run in" in _line(capsys)
    assert main(["eval", "--agent", str(agent), *RUN, "--out", str(tmp_path / "run" / "eval")]) == 0
    assert (tmp_path / "run" / "eval" / "results.json").is_file()
