"""What a resumed run finds and reports: a metrics file full of garbage (moved aside, said so), damaged
lines in it (counted and named), and the temporary folders of a final export killed with -9 (removed)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from hacrl_megatron.cli import main
from hacrl_megatron.trainer.metrics import read_metrics
from tests.faults.trainer_helpers import preset_file, tiny


def _finished(tmp_path, steps=1):
    exp = tiny(tmp_path, steps=steps, every=1)
    preset = preset_file(tmp_path, exp)
    assert main(["train", "--preset", preset]) == 0
    return exp, preset, Path(exp.output_dir)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "metrics.jsonl" in r.getMessage()]


def test_resume_over_a_metrics_file_of_garbage_moves_it_aside_and_says_so(tmp_path, caplog):
    exp, preset, out = _finished(tmp_path)
    metrics = out / "metrics.jsonl"
    garbage = b"".join(bytes([65 + i % 26]) * 40 + b"\n" for i in range(30)) + b"\x00\xff torn"
    metrics.write_bytes(garbage)
    caplog.set_level(logging.WARNING, logger="hacrl_megatron")
    assert main(["train", "--preset", preset, "checkpoint.resume=true", "train.steps=2"]) == 0
    assert _warnings(caplog) == [
        f"{metrics}: none of its 31 lines is a metrics row (not a metrics row (JSONDecodeError; a torn write?) at "
        "line 1): not a metrics file of this run, or damaged; moved aside to metrics.jsonl.unreadable-1 and a new one "
        "started"]
    assert (out / "metrics.jsonl.unreadable-1").read_bytes() == garbage  # nothing is cut away
    assert [r["step"] for r in read_metrics(metrics)] == [2]


def test_resume_counts_and_names_damaged_lines_and_keeps_them(tmp_path, caplog):
    exp, preset, out = _finished(tmp_path, steps=2)
    metrics = out / "metrics.jsonl"
    rows = metrics.read_text().splitlines()
    metrics.write_text("\n".join([rows[0], "garbage", rows[1], "{\"no\": \"step\"}"]) + "\n" + '{"step": 3, "to')
    caplog.set_level(logging.WARNING, logger="hacrl_megatron")
    assert main(["train", "--preset", preset, "checkpoint.resume=true", "train.steps=3"]) == 0
    assert _warnings(caplog) == [
        f"{metrics}: 2 of its 5 lines are not metrics rows (line 2, 4); they are kept, and read_metrics skips them",
        f"{metrics}: removed a torn last line (line 5, 15 bytes) left by an interrupted run"]
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3]


def test_a_final_export_killed_with_9_leaves_nothing_after_the_resumed_run(tmp_path):
    exp, preset, out = _finished(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftovers = [out / "final" / f".llama.tmp{dead.pid}", out / "final" / f".qwen3.old{dead.pid}"]
    for folder in leftovers:  # what a kill -9 inside atomic_save_dir leaves: a partial export, a set-aside one
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    assert main(["train", "--preset", preset, "checkpoint.resume=true"]) == 0  # already at its last step: exports
    assert sorted(p.name for p in (out / "final").iterdir()) == ["llama", "qwen3"]
    assert json.loads((out / "final" / "llama" / "config.json").read_text())["model_type"] == "llama"
