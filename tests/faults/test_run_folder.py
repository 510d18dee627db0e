"""One run per output folder: a second run refuses (exit 2, folder named) instead of pruning the
first run's checkpoints; a resume continues only with an agreeing config; a live run's lock blocks
another, a dead run's lock does not; every folder a run writes (output_dir, checkpoint.dir) is
claimed by the same rule and a run's identity (run.json) is never overwritten by another run."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hacrl_megatron.cli import main
from hacrl_megatron.trainer import loop
from hacrl_megatron.trainer.metrics import read_metrics
from hacrl_megatron.trainer.run_folder import (
    LOCK_FILE,
    FolderLock,
    RunFolderError,
    claim_run_folder,
    config_differences,
)
from tests.faults.trainer_helpers import exp_with, preset_file, tiny

HOLD_LOCK = ("import sys, time; from pathlib import Path; from hacrl_megatron.trainer.run_folder import FolderLock; "
             "FolderLock.acquire(Path(sys.argv[1])); print('locked', flush=True); time.sleep(120)")


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (the lock file aside) → its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


@pytest.fixture
def finished_run(tmp_path):
    """A 4-step tiny run through `hacrl train` with checkpoints at steps 2 and 4: (exp, preset file)."""
    exp = tiny(tmp_path, steps=4, every=2)
    preset = preset_file(tmp_path, exp)
    assert main(["train", "--preset", preset]) == 0
    assert sorted(p.name for p in (Path(exp.output_dir) / "checkpoints").glob("step-*")) == ["step-000002",
                                                                                            "step-000004"]
    return exp, preset


def test_new_run_into_a_used_folder_refuses_and_deletes_nothing(finished_run, capsys):
    exp, preset = finished_run
    out = Path(exp.output_dir)
    before = snapshot(out)
    capsys.readouterr()
    assert main(["train", "--preset", preset, "train.seed=1", "train.steps=2"]) == 2
    err = capsys.readouterr().err
    assert f"{out} already holds a run" in err and "checkpoint.resume=true" in err
    assert "2 checkpoint(s)" in err and "metrics.jsonl" in err
    assert snapshot(out) == before  # the first run's checkpoints, metrics and exports are untouched


def test_resume_with_other_weight_shaping_fields_refuses_and_lists_them(finished_run, capsys):
    exp, preset = finished_run
    before = snapshot(Path(exp.output_dir))
    capsys.readouterr()
    assert main(["train", "--preset", preset, "checkpoint.resume=true", "train.seed=1", "hacpo.alpha=2",
                 "train.steps=6"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume the run in" in err and str(Path(exp.output_dir).resolve()) in err
    assert "train.seed: 0 (saved) vs 1 (now)" in err and "hacpo.alpha: 1.0 (saved) vs 2.0 (now)" in err
    assert "train.steps" not in err  # a resume may run longer
    assert snapshot(Path(exp.output_dir)) == before


def test_resume_may_change_length_logging_and_checkpoint_frequency(finished_run, capsys):
    exp, preset = finished_run
    capsys.readouterr()
    assert main(["train", "--preset", preset, "checkpoint.resume=true", "train.steps=6", "checkpoint.every=3",
                 "log.every=2"]) == 0
    err = capsys.readouterr().err
    assert "resumed from step 4 (" in err
    ckpts = sorted(p.name for p in (Path(exp.output_dir) / "checkpoints").glob("step-*"))
    assert ckpts == ["step-000004", "step-000006"]
    assert [r["step"] for r in read_metrics(Path(exp.output_dir) / "metrics.jsonl")] == [1, 2, 3, 4, 6]
    record = json.loads((Path(exp.output_dir) / "run.json").read_text())
    assert [s["resume"] for s in record["starts"]] == [False, True] and record["config"]["train"]["steps"] == 6


def test_config_differences_ignore_what_a_resume_may_change():
    saved = {"train": {"steps": 4, "seed": 0, "eval_every": 2}, "log": {"every": 1},
             "agents": [{"name": "a", "lr": 1e-3, "parallel": {"tp": 1, "use_distributed_optimizer": False}}]}
    now = {"train": {"steps": 8, "seed": 0, "eval_every": 5}, "log": {"every": 3},
           "agents": [{"name": "a", "lr": 1e-3, "parallel": {"tp": 2, "use_distributed_optimizer": True}}]}
    assert config_differences(saved, now) == [
        "agents.0.parallel.use_distributed_optimizer: False (saved) vs True (now)"]
    now["agents"].append(now["agents"][0])
    assert config_differences(saved, now)[0] == "agents: 1 agents (saved) vs 2 (now)"


def test_resume_may_change_weight_sync_bucket_and_colocation_but_not_sampling():
    saved = {"rollout": {"weight_sync": "disk", "weight_sync_bucket_mb": 512, "colocate": False, "temperature": 1.0}}
    now = {"rollout": {"weight_sync": "distributed", "weight_sync_bucket_mb": 64, "colocate": True,
                       "temperature": 0.7}}
    assert config_differences(saved, now) == ["rollout.temperature: 1.0 (saved) vs 0.7 (now)"]


def test_resume_into_an_empty_folder_says_it_starts_fresh(tmp_path, capsys):
    exp = tiny(tmp_path, steps=1, every=1)
    assert main(["train", "--preset", preset_file(tmp_path, exp), "checkpoint.resume=true"]) == 0
    root = Path(exp.output_dir) / "checkpoints"
    assert f"checkpoint.resume=true but no checkpoint in {root}: starting fresh" in capsys.readouterr().err


def test_locked_folder_refuses_a_second_run_and_a_dead_holder_does_not_block(tmp_path, capsys, caplog):
    exp = tiny(tmp_path, steps=1, every=1)
    preset = preset_file(tmp_path, exp)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, exp.output_dir], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["train", "--preset", preset]) == 2
        err = capsys.readouterr().err
        assert f"{Path(exp.output_dir).resolve()} is in use by another run (pid {holder.pid} host" in err
        assert not (Path(exp.output_dir) / "checkpoints").exists()  # refused before any work
    finally:
        holder.kill()  # like kill -9: the lock file still names it, but the kernel dropped its lock
        holder.wait()
    caplog.set_level(logging.WARNING, logger="hacrl_megatron")
    assert main(["train", "--preset", preset]) == 0
    assert any("stale lock" in r.message and f"pid {holder.pid}" in r.message for r in caplog.records)
    assert (Path(exp.output_dir) / LOCK_FILE).read_text() == ""  # released at the end of the run


def test_lock_is_released_when_the_run_fails_and_a_run_that_did_nothing_blocks_nothing(tmp_path, monkeypatch):
    exp = tiny(tmp_path, steps=1, every=1)

    def broken_setup(exp):
        raise RuntimeError("setup failed")

    monkeypatch.setattr(loop, "setup", broken_setup)
    with pytest.raises(RuntimeError, match="setup failed"):
        loop.train(exp)
    FolderLock.acquire(Path(exp.output_dir)).release()  # a second lock in this process would fail if still held
    monkeypatch.undo()
    assert loop.train(exp).step == 1  # only run.json was left: nothing to protect, no resume needed


def test_checkpoint_folder_outside_the_output_folder_is_locked_and_recorded_too(tmp_path):
    exp = tiny(tmp_path, checkpoint={"dir": str(tmp_path / "shared-ckpts")})
    with claim_run_folder(exp):
        with pytest.raises(RunFolderError, match="shared-ckpts is in use by another run"):
            FolderLock.acquire(tmp_path / "shared-ckpts")
    assert json.loads((tmp_path / "shared-ckpts" / "run.json").read_text())["config"]["train"]["seed"] == 0
    (tmp_path / "shared-ckpts" / "step-000002").mkdir()  # the first run got to a checkpoint
    other = exp_with(tiny(tmp_path / "other", checkpoint={"dir": str(tmp_path / "shared-ckpts"), "resume": True}),
                     train={"seed": 5})
    with pytest.raises(RunFolderError, match=r"train.seed: 0 \(saved\) vs 5 \(now\)"):
        claim_run_folder(other)


def test_without_flock_a_live_pid_refuses_and_a_dead_pid_is_stale(tmp_path, monkeypatch):
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    folder = tmp_path / "run"
    folder.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (folder / LOCK_FILE).write_text(f"pid {sleeper.pid} host {socket.gethostname()} since x\n")
        with pytest.raises(RunFolderError, match=f"in use by another run \\(pid {sleeper.pid}"):
            FolderLock.acquire(folder)
    finally:
        sleeper.kill()
        sleeper.wait()
    lock = FolderLock.acquire(folder)  # the recorded process is gone: stale, taken over
    assert not lock.uses_flock and f"pid {os.getpid()}" in (folder / LOCK_FILE).read_text()
    lock.release()
    (folder / LOCK_FILE).write_text("pid 1 host some-other-host since x\n")
    with pytest.raises(RunFolderError, match="if that run is gone, delete"):
        FolderLock.acquire(folder)


# -- issue 25 item 1: checkpoint.dir and output_dir never take over another run's folder ---------------


def test_checkpoint_dir_at_another_runs_output_folder_is_refused_and_that_run_still_resumes(finished_run, tmp_path,
                                                                                          capsys):
    exp, preset = finished_run
    first = Path(exp.output_dir)
    before = snapshot(first)
    other = tmp_path / "other"
    capsys.readouterr()
    assert main(["train", "--preset", preset, f"output_dir={other}", f"checkpoint.dir={first}", "train.seed=5"]) == 2
    assert f"{first.resolve()} already holds a run (metrics.jsonl, final, 2 checkpoint(s) in" in capsys.readouterr().err
    assert main(["train", "--preset", preset, f"output_dir={other}", f"checkpoint.dir={first}", "train.seed=5",
                 "checkpoint.resume=true"]) == 2
    err = capsys.readouterr().err
    assert f"cannot resume in {first.resolve()}: it is the output folder of a run" in err
    assert snapshot(first) == before  # run.json (the first run's identity) and everything else untouched
    assert main(["train", "--preset", preset, "checkpoint.resume=true", "train.steps=5"]) == 0
    assert "resumed from step 4 (" in capsys.readouterr().err


def test_checkpoint_dir_inside_another_runs_folder_is_refused_also_on_a_resume(finished_run, tmp_path, capsys):
    exp, preset = finished_run
    first = Path(exp.output_dir).resolve()
    before = snapshot(first)
    capsys.readouterr()
    for extra in ([], ["checkpoint.resume=true"]):
        assert main(["train", "--preset", preset, f"output_dir={tmp_path / 'other'}",
                     f"checkpoint.dir={first / 'checkpoints'}", *extra]) == 2
        assert (f"{first / 'checkpoints'} lies inside {first}, a folder of another run ({first / 'run.json'})"
                in capsys.readouterr().err)
    assert main(["train", "--preset", preset, f"output_dir={first / 'sub'}"]) == 2
    assert f"{first / 'sub'} lies inside {first}, a folder of another run" in capsys.readouterr().err
    assert snapshot(first) == before and not (first / "sub").exists()


def test_run_record_holds_the_run_id_and_role_and_a_resume_keeps_them(tmp_path):
    exp = tiny(tmp_path, steps=1, every=1, checkpoint={"dir": str(tmp_path / "ckpts")})
    loop.train(exp)
    out, ckpts = (json.loads((p / "run.json").read_text()) for p in (Path(exp.output_dir), tmp_path / "ckpts"))
    assert (out["role"], ckpts["role"]) == ("output", "checkpoints") and out["run_id"] == ckpts["run_id"]
    assert len(out["run_id"]) == 32
    loop.train(exp_with(exp, train={"steps": 2}, checkpoint={"resume": True}))
    again = json.loads((Path(exp.output_dir) / "run.json").read_text())
    assert again["run_id"] == out["run_id"] and [s["resume"] for s in again["starts"]] == [False, True]
    # another run may reuse the checkpoints of this one only as a resume of the same run
    with pytest.raises(RunFolderError, match=r"tmp.*ckpts already holds a run \(2 checkpoint\(s\)"):
        claim_run_folder(exp_with(tiny(tmp_path / "b", checkpoint={"dir": str(tmp_path / "ckpts")})))


def test_engine_sections_may_change_on_resume():
    """Moving servers (rollout.sglang.tp, .placement) or resizing the HF engine's batches shapes neither
    the weights nor the data: a resume may change them (the flat rollout.sglang_* keys of older runs too)."""
    from hacrl_megatron.trainer.run_folder import config_differences

    saved = {"rollout": {"sglang": {"tp": 1, "placement": "local"}, "hf": {"max_batch_size": 64},
                         "vllm": {"tp": 1}, "sglang_tp": 1, "temperature": 1.0}}
    now = {"rollout": {"sglang": {"tp": 4, "placement": "ray"}, "hf": {"max_batch_size": 8},
                       "vllm": {"tp": 2}, "sglang_tp": 4, "temperature": 1.0}}
    assert config_differences(saved, now) == []
    now["rollout"]["temperature"] = 0.7
    assert config_differences(saved, now) == ["rollout.temperature: 1.0 (saved) vs 0.7 (now)"]
