"""A run killed after logging steps past its last checkpoint, then resumed: ``metrics.jsonl`` keeps one
row per step (the rows the resume replays are set aside, not lost) and every metric of the resumed
steps, ``<agent>/rollout_tokens_total`` included, equals the unbroken run's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hacrl_megatron.cli import main
from tests.faults.trainer_helpers import preset_file, tiny


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_killed_and_resumed_run_logs_each_step_once_and_continues_its_token_count(tmp_path):
    exp = tiny(tmp_path, steps=4, every=2)
    preset = preset_file(tmp_path, exp)
    assert main(["train", "--preset", preset]) == 0
    run = Path(exp.output_dir)
    unbroken = {json.loads(line)["step"]: json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()}
    assert sorted(unbroken) == [1, 2, 3, 4]
    # the state of a run killed after logging step 4, before its checkpoint and its final export
    shutil.rmtree(run / "checkpoints" / "step-000004")
    shutil.rmtree(run / "final")
    assert main(["train", "--preset", preset, "checkpoint.resume=true"]) == 0
    assert _steps(run / "metrics.jsonl") == [1, 2, 3, 4]
    assert _steps(run / "metrics.jsonl.replayed-1") == [3, 4]  # the first process's rows, kept aside
    resumed = {json.loads(line)["step"]: json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()}
    for step in (3, 4):
        for name in ("llama", "qwen3"):
            assert resumed[step][f"{name}/rollout_tokens_total"] == unbroken[step][f"{name}/rollout_tokens_total"]
            assert resumed[step][f"{name}/rollout_tokens_total"] > unbroken[2][f"{name}/rollout_tokens_total"] > 0
            assert resumed[step][f"{name}/hacpo/loss"] == pytest.approx(unbroken[step][f"{name}/hacpo/loss"],
                                                                         rel=1e-6, abs=1e-9)
