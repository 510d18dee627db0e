"""Fault injection on user inputs: malformed YAML, damaged data files, impossible data settings, a
tokenizer larger than the model. Each must fail before any work, exit 2 and name the file or field."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from hacrl_megatron.cli import main
from hacrl_megatron.data import DataFileError, load_benchmark, make_task

torch.set_num_threads(1)

MATH500_ROW = {"problem": "What is 1+1?", "answer": "2", "unique_id": "test/a/1.json"}


def _jsonl(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _err(capsys) -> str:
    return capsys.readouterr().err


# -- item 5: malformed YAML names file, line, column and what was expected --------------------------


def test_malformed_preset_file_names_file_line_column_and_expectation(tmp_path, capsys):
    preset = tmp_path / "mine.yaml"
    preset.write_text("name: x\nagents:\n  - name: a\n    lr: [1, 2\ntrain: {steps: 3}\n")
    assert main(["config", "--preset", str(preset)]) == 2
    err = _err(capsys)
    assert f"preset file {preset}: malformed YAML at line 5, column 6: expected ',' or ']'" in err
    assert "started at line 4, column 9" in err  # where the unclosed list began
    assert "Traceback" not in err


def test_malformed_base_preset_is_named_not_the_child(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text("train:\n\tsteps: 3\n")
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {tmp_path / 'base.yaml'}\nname: c\n")
    assert main(["config", "--preset", str(child)]) == 2
    assert f"preset file {tmp_path / 'base.yaml'}: malformed YAML at line 2, column 1" in _err(capsys)


def test_malformed_override_value_names_the_override(capsys):
    assert main(["config", "train.steps=[1,"]) == 2
    assert "override 'train.steps=[1,': the value is malformed YAML at line 1, column 4" in _err(capsys)


# -- item 6: data files: empty, broken line, skipped rows ---------------------------------------------


def test_empty_jsonl_names_the_file(tmp_path):
    empty = tmp_path / "test.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataFileError, match=f"{empty}: empty file"):
        load_benchmark("math500", str(empty))


def test_broken_jsonl_line_names_file_and_line(tmp_path):
    f = _jsonl(tmp_path / "test.jsonl", [json.dumps(MATH500_ROW), "", '{"problem": "2+2", "answer": "4"'])
    with pytest.raises(DataFileError, match=rf"{f}:3: not valid JSON \(Expecting ',' delimiter at column 33\)"):
        load_benchmark("math500", str(f))


def test_json_array_and_parquet_damage_are_named(tmp_path):
    arr = tmp_path / "test.json"
    arr.write_text('[{"problem": "a", "answer": "1", "unique_id": "x"},\n {"problem": }]')
    with pytest.raises(DataFileError, match=f"{arr}:2: not valid JSON"):
        load_benchmark("math500", str(arr))
    pq = tmp_path / "test-00000-of-00001.parquet"
    pq.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataFileError, match=f"{pq}: not a readable parquet file"):
        load_benchmark("gsm8k", str(pq))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"problem": "caf\xe9", "answer": "1", "unique_id": "x"}\n')
    with pytest.raises(DataFileError, match=f"{latin}: not UTF-8 text"):
        load_benchmark("math500", str(latin))


def test_skipped_rows_are_counted_and_located(tmp_path, caplog):
    rows = [MATH500_ROW, {**MATH500_ROW, "answer": ""}, {**MATH500_ROW, "problem": " "},
            {**MATH500_ROW, "unique_id": "test/a/2.json"}]
    f = _jsonl(tmp_path / "test.jsonl", [json.dumps(r) for r in rows])
    with caplog.at_level(logging.WARNING):
        assert len(load_benchmark("math500", str(f))) == 2
    assert f"math500: skipped 2 of 4 rows without a question or a reference answer: {f}:2, {f}:3" in caplog.text
    nothing = _jsonl(tmp_path / "none.jsonl", [json.dumps({**MATH500_ROW, "answer": ""})])
    with pytest.raises(DataFileError, match=f"{nothing}: all 1 math500 rows lack a question or a reference answer"):
        load_benchmark("math500", str(nothing))
    null = _jsonl(tmp_path / "null.jsonl", [json.dumps({**MATH500_ROW, "answer": None})])
    with pytest.raises(DataFileError, match=rf"{null}:1: math500 row has no value in column answer \(missing or null\)"):
        load_benchmark("math500", str(null))


def test_hacrl_eval_on_a_broken_data_file_exits_2_naming_file_and_line(tmp_path, capsys):
    agent = _tiny_agent(tmp_path, "char", "char")
    bad = _jsonl(tmp_path / "test.jsonl", [json.dumps(MATH500_ROW), "{oops"])
    rc = main(["eval", "--agent", str(agent), "--benchmarks", "math500", "--data", f"math500={bad}",
               "--max-new-tokens", "2"])
    assert rc == 2
    assert f"{bad}:2: not valid JSON" in _err(capsys)


# -- item 7: a tokenizer larger than the model -----------------------------------------------------


def _tiny_agent(tmp_path, model_tokenizer: str, name: str):
    from hacrl_megatron.exchange import load_tokenizer
    from tests.unit.test_rollout_hf import tiny_llama

    tok = load_tokenizer(model_tokenizer, tmp_path / "tok")
    tiny_llama(len(tok), seed=0).save_pretrained(tmp_path / name)
    tok.save_pretrained(tmp_path / name)
    return tmp_path / name


def test_hacrl_eval_with_a_tokenizer_larger_than_the_model_exits_2(tmp_path, capsys):
    from hacrl_megatron.exchange import load_tokenizer

    agent = _tiny_agent(tmp_path, "char", "char_model")
    small, big = len(load_tokenizer("char", tmp_path / "tok")), len(load_tokenizer("pair", tmp_path / "tok"))
    assert big > small
    rc = main(["eval", "--agent", str(agent), "--tokenizer", "pair", "--benchmarks", "addition", "--limit", "2",
               "--max-new-tokens", "2", "--template", "plain"])
    assert rc == 2
    err = _err(capsys)
    assert f"tokenizer 'pair' has {big} tokens but the model in {agent} has vocab_size={small}" in err
    assert "Traceback" not in err


# -- item 8: data.task / data.path checked before any work ------------------------------------------


def test_hacrl_config_rejects_an_unknown_task(capsys):
    assert main(["config", "data.task=nonsense"]) == 2
    err = _err(capsys)
    assert "data.task='nonsense': must be a procedural task ['addition'" in err and "'math500'" in err


def test_hacrl_config_rejects_a_missing_data_path_and_a_path_for_a_procedural_task(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert main(["config", "data.task=math500", f"data.path={missing}", "data.allow_test_split=true"]) == 2
    assert f"data.path='{missing}': benchmark 'math500': no such file {missing}" in _err(capsys)
    assert main(["config", "data.task=addition", f"data.path={missing}"]) == 2
    assert "data.path=" in _err(capsys)


def test_training_reads_the_data_before_warm_up_or_model_build(tmp_path, capsys, monkeypatch):
    from hacrl_megatron.trainer import loop

    def never(*args, **kwargs):
        raise AssertionError("warm-up or model build started before the data was checked")

    for name in ("apply_warmup", "build_runtime", "configure_process"):
        monkeypatch.setattr(loop, name, never)
    bad = _jsonl(tmp_path / "test.jsonl", [json.dumps(MATH500_ROW), '{"problem": 1,'])
    rc = main(["train", "--preset", "cpu_demo", "data.task=math500", f"data.path={bad}", "data.allow_test_split=true",
               "train.sft_warmup=true",
               f"output_dir={tmp_path / 'run'}", "log.tensorboard=false", "log.progress=false"])
    assert rc == 2
    assert f"{bad}:2: not valid JSON" in _err(capsys)


def test_dataset_task_with_good_data_still_loads(tmp_path):
    f = _jsonl(tmp_path / "test.jsonl", [json.dumps({**MATH500_ROW, "unique_id": f"id{i}"}) for i in range(12)])
    task = make_task("math500", seed=3, path=str(f), eval_holdout=2, allow_test_split=True)
    assert len(task.eval_set(2)) == 2 and len(task.sample(10)) == 10
