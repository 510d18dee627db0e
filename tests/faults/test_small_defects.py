"""Smaller defects found by a hostile user: a hub id that leaves --out, `hacrl samples` on damaged files or a
closed pipe, --per-agent-jobs without NeMo-Run, a prompt column named wrong, a sequence longer than the
model's positions, and a damaged final/ folder evaluated as noise."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hacrl_megatron.cli import main
from tests.faults.test_eval_inputs import RUN, agent  # noqa: F401  (agent: the module's fixture)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("repo_id", ["owner/..", "./.", "../etc", "owner/.", "a/b/c", "owner/-x"])
def test_a_hub_id_that_would_leave_out_is_refused(tmp_path, capsys, repo_id):
    out = tmp_path / "deep" / "models"
    assert main(["prepare", "model", repo_id, "--out", str(out), "--mirror", str(tmp_path / "mirror")]) == 2
    assert "expected OWNER/NAME as on the hub" in capsys.readouterr().err
    assert not (tmp_path / "deep").exists()  # nothing written, inside --out or beside it
    assert main(["prepare", "model", "owner/name", "--name", "..", "--out", str(out)]) == 2
    assert "--name '..': a folder name under --out" in capsys.readouterr().err


def _samples(tmp_path: Path, content: bytes) -> Path:
    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    (run / "samples" / "step-000002.jsonl").write_bytes(content)
    return run


ROW = {"step": 2, "index": 0, "id": "p0", "question": "1+1=", "reference": "2",
       "agents": {"llama": [{"text": "2", "reward": 1.0, "length": 1, "finish_reason": "eos"}]}}


@pytest.mark.parametrize("content, named", [
    (b"\xff\xfe not utf-8\n", "step-000002.jsonl:1: not UTF-8 text (byte 0)"),
    (b"[" * 100_000 + b"\n", "step-000002.jsonl:1: not a samples row (nested too deeply)"),
    (json.dumps({**ROW, "agents": [1, 2]}).encode() + b"\n", "field 'agents' is a list, not a samples row's dict"),
    (json.dumps({**ROW, "agents": {"llama": [{"text": "2"}]}}).encode() + b"\n",
     "field 'agents.llama[0].reward' missing"),
    (b"[1, 2]\n", "field '(the row)' is a list"),
])
def test_samples_on_a_damaged_file_is_one_line(tmp_path, capsys, content, named):
    assert main(["samples", str(_samples(tmp_path, content))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and named in err, err


def test_samples_cuts_a_huge_question_and_survives_a_closed_pipe(tmp_path, capsys):
    rows = [{**ROW, "index": i, "question": "q" * 100_000} for i in range(200)]
    run = _samples(tmp_path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    assert main(["samples", str(run), "--prompt", "0"]) == 0
    out = capsys.readouterr().out
    assert "…[98000 more characters]" in out and len(out) < 3000
    piped = subprocess.run(f"{shlex.quote(sys.executable)} -m hacrl_megatron samples {shlex.quote(str(run))} | head -n 2", shell=True,
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert len(piped.stdout.splitlines()) == 2 and "BrokenPipe" not in piped.stderr and "Traceback" not in piped.stderr


def test_per_agent_jobs_without_nemo_run_start_no_job(tmp_path, monkeypatch, capsys):
    import hacrl_megatron.launch.per_agent as per_agent

    started = []
    monkeypatch.setattr(per_agent, "run_agent_jobs", lambda jobs, *a, **k: started.append(jobs) or 0)
    monkeypatch.setitem(sys.modules, "nemo_run", None)  # `import nemo_run` raises ImportError
    code = main(["launch", "--per-agent-jobs", "exchange.backend=shared_dir", f"exchange.dir={tmp_path / 'ex'}"])
    assert code == 2 and not started
    assert "hacrl launch needs NeMo-Run" in capsys.readouterr().err


def test_a_named_prompt_column_of_the_wrong_type_is_named(tmp_path, capsys):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"id": "a", "uid": 5, "answer": "x"}\n{"id": "b", "uid": 6, "answer": "y"}\n')
    assert main(["config", "data.task=custom", f"data.path={path}", "data.prompt_key=uid", "data.eval_size=0"]) == 2
    assert f"{path}:1: column uid (data.prompt_key): the question must be text, got int" in capsys.readouterr().err


def test_plan_refuses_a_sequence_longer_than_the_models_positions(tmp_path, capsys):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["plan", "--model", str(tmp_path), "--tp", "1", "--pp", "1", "--dp", "1", "--gpu-memory-gib", "80"]
    assert main([*args, "--seq-len", "100000000000000"]) == 2
    err = capsys.readouterr().err
    assert "--seq-len=100000000000000: model" in err and "has 4096 positions (max_position_embeddings)" in err
    assert main([*args, "--seq-len", "4096"]) == 0


@pytest.mark.parametrize("damage", ["a tensor missing", "NaN weights"])
def test_eval_of_a_damaged_final_folder_is_refused_not_scored_zero(agent, tmp_path, capsys, damage):  # noqa: F811
    folder = tmp_path / "final"
    shutil.copytree(agent, folder)
    weights = load_file(folder / "model.safetensors")
    name = next(k for k in weights if "layers.0.mlp" in k)
    if damage == "a tensor missing":
        del weights[name]
    else:
        weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert main(["eval", "--agent", str(folder), *RUN]) == 2
    # only our own lines: transformers' log handler may hold a stderr captured by an earlier test of this process
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hacrl")]
    assert line.startswith(f"hacrl: --agent {folder}: ") and name in line
