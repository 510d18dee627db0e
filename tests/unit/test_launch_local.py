"""NeMo-Run LocalExecutor end to end: a real 1-step HACRL training job (two tiny hf-backend agents)
launched as a subprocess, and a failing job whose state and log come back as a LaunchError."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("nemo_run")
pytest.importorskip("transformers")

from hacrl_megatron.launch import LaunchError, launch_train, local_executor  # noqa: E402

TINY = ["train.steps=1", "train.sft_warmup=false", "train.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.max_response_len=4", "data.eval_size=0", "train.eval_every=0", "checkpoint.every=0",
        "log.tensorboard=false", "log.progress=false", "agents.0.backend=hf", "agents.1.backend=hf",
        "train.verifier_workers=0"]


@pytest.fixture(autouse=True)
def readable_stdin(monkeypatch):
    with open(os.devnull) as null:  # invoke (inside NeMo-Run) reads stdin; pytest's raises on read
        monkeypatch.setattr(sys, "stdin", null)
        yield


def test_local_executor_runs_a_one_step_training_job(tmp_path):
    out = tmp_path / "run"
    result = launch_train("cpu_demo", TINY + [f"output_dir={out}"], local_executor(env_vars={"OMP_NUM_THREADS": "1"}),
                          "tiny", base_dir=str(tmp_path / "exp"))
    assert result.ok and result.state == "SUCCEEDED"
    assert result.job_dir.startswith(str(tmp_path / "exp")) and os.path.isfile(result.log_path)
    (line,) = (out / "metrics.jsonl").read_text().splitlines()
    metrics = json.loads(line)
    assert metrics["step"] == 1
    assert {"llama/hacpo/loss", "qwen3/hacpo/loss"} <= set(metrics)


def test_failed_job_is_reported_not_swallowed(tmp_path):
    # exp.run returns normally for a failed job (docs/measured.md §4): the state is read back
    with pytest.raises(LaunchError, match=r"job 'bad' .* ended in state FAILED[\s\S]*hacpo.alpha=-1.0: must be >= 0"):
        launch_train(None, ["hacpo.alpha=-1"], local_executor(), "bad", subcommand="config",
                     base_dir=str(tmp_path / "exp"))
    result = launch_train(None, ["hacpo.alpha=-1"], local_executor(), "bad2", subcommand="config",
                          base_dir=str(tmp_path / "exp"), check=False)
    assert not result.ok and result.state == "FAILED"
