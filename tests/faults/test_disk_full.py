"""A full disk: the save says "no space left on <path>, needed ~N MB", removes its temp folder and
leaves the previous checkpoint loadable; the error that stopped the run stays the one reported; the
run resumes once space is freed; metrics.jsonl never keeps a torn row, and readers survive one.

Each case runs twice where it can: with ENOSPC injected (no privileges needed) and on a real 40 MB
tmpfs (needs root and mount permission; skipped with the reason otherwise).
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from hacrl_megatron import durable
from hacrl_megatron.cli import main
from hacrl_megatron.durable import OutOfSpaceError
from hacrl_megatron.trainer import checkpoint as ckpt
from hacrl_megatron.trainer import loop, run_checkpoints
from hacrl_megatron.trainer import metrics as metrics_mod
from hacrl_megatron.trainer.metrics import JsonlWriter, MetricsLogger, read_metrics, read_metrics_lines
from hacrl_megatron.trainer.run_folder import checkpoint_dir
from tests.faults.trainer_helpers import exp_with, preset_file, resume_and_step, start, tiny
from tests.unit.tool_loading import load_tool


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 40 MB tmpfs (needs root and mount permission): {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(folder: Path) -> Path:
    """Write a ballast file until ``folder``'s filesystem is full; returns it (delete it to free the space)."""
    ballast = folder / "ballast"
    chunk = b"\0" * (1 << 16)
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as err:
            assert err.errno == errno.ENOSPC
    for size in (4096, 1):  # the partly filled last blocks too
        try:
            with open(folder / f"ballast-{size}", "wb", buffering=0) as f:
                while True:
                    f.write(b"\0" * size)
        except OSError:
            pass
    return ballast


def free_space(folder: Path) -> None:
    for p in folder.glob("ballast*"):
        p.unlink()


# --------------------------------------------------------------------------------------------
# checkpoints


def test_injected_enospc_during_a_save_keeps_the_previous_checkpoint_and_the_run_resumes(tmp_path, monkeypatch):
    exp = tiny(tmp_path, steps=2, every=1)
    root = checkpoint_dir(exp)
    run = start(exp)
    try:
        loop.train_step(run)
        loop._save(run)
        loop.train_step(run)
        real_end_save = run.runtimes[1].trainer.end_save

        def save_then_disk_full():
            real_end_save()  # this agent's files land; the next write finds the disk full
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(run.runtimes[1].trainer, "end_save", save_then_disk_full)
        with pytest.raises(OutOfSpaceError) as info:
            loop._save(run)
    finally:
        for rt in run.runtimes:
            rt.close()
    message = str(info.value)
    assert message.startswith(f"no space left on {root}, needed ~") and "MB (the size of step-000001)" in message
    assert list(root.glob(".tmp-*")) == []  # the failed temp folder is gone
    assert ckpt.find_resume_checkpoint(root).name == "step-000001"
    resumed, _ = resume_and_step(exp, 1)  # space is back: resume, step and save again
    try:
        assert resumed.step == 2
        loop._save(resumed)
        assert ckpt.verify_checkpoint(root / "step-000002")
    finally:
        for rt in resumed.runtimes:
            rt.close()


def torch_zip_writer_error(monkeypatch, run):
    """torch.save on a full disk: ``RuntimeError: [enforce fail ...] unexpected pos`` (no errno)."""
    def fail(obj, f, *args, **kwargs):
        f.write(b"partial")  # checkpoint files are written through hashing file objects
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", fail)


def megatron_writer_error(monkeypatch, run):
    """megatron's dist checkpoint writer on a full disk: torch's CheckpointException (a BaseException)
    carrying the writer process's ``Worker failure`` per rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    def fail(path, background=False):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "__0_0.distcp").write_bytes(b"partial")
        worker = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        raise CheckpointException("write", {0: (worker, None)})

    monkeypatch.setattr(run.runtimes[0].trainer, "begin_save", fail)


@pytest.mark.parametrize("writer", [torch_zip_writer_error, megatron_writer_error])
def test_a_full_disk_hidden_behind_a_writer_error_is_named(tmp_path, monkeypatch, writer):
    """The writers do not say "no space": the nearly-zero free space at the failure tells."""
    exp = tiny(tmp_path, steps=1, every=1)
    run = start(exp)
    root = checkpoint_dir(exp)
    try:
        loop.train_step(run)
        writer(monkeypatch, run)
        monkeypatch.setattr(durable, "free_bytes", lambda path: 0)
        with pytest.raises(OutOfSpaceError, match=rf"no space left on {root}, needed more than ~.* MB \(written"):
            loop._save(run)
        assert list(root.glob(".tmp-*")) == []
        monkeypatch.undo()
        monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("unrelated")))
        with pytest.raises(RuntimeError, match="^unrelated$"):  # with space left, other errors stay themselves
            loop._save(run)
        assert list(root.glob(".tmp-*")) == []
    finally:
        for rt in run.runtimes:
            rt.close()


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_full_tmpfs_mid_run_then_resume_after_freeing_space(small_tmpfs, monkeypatch, backend):
    exp = tiny(small_tmpfs, backend=backend, steps=3, every=1)
    root = checkpoint_dir(exp)
    real_save = loop._save

    def fill_then_save(run):
        if run.step == 2:
            fill(small_tmpfs)
        real_save(run)

    monkeypatch.setattr(loop, "_save", fill_then_save)
    with pytest.raises(OutOfSpaceError, match=rf"no space left on {root}, needed ~[0-9.]+ MB"):
        loop.train(exp)
    assert list(root.glob(".tmp-*")) == []
    assert ckpt.find_resume_checkpoint(root).name == "step-000001"
    rows, torn = read_metrics_lines(small_tmpfs / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and torn == []
    free_space(small_tmpfs)
    monkeypatch.setattr(loop, "_save", real_save)
    run = loop.train(exp_with(exp, checkpoint={"resume": True}))
    assert run.step == 3
    assert [r["step"] for r in read_metrics(small_tmpfs / "run" / "metrics.jsonl")] == [1, 2, 3]
    assert ckpt.verify_checkpoint(root / "step-000003")


def test_the_error_that_stopped_the_run_stays_primary(tmp_path, monkeypatch, caplog, capsys):
    exp = tiny(tmp_path, steps=2, every=1)

    def no_space(root, *args, **kwargs):
        raise OutOfSpaceError(f"no space left on {root}, needed ~1.0 MB")

    def close_fails(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_checkpoints, "begin_checkpoint", no_space)
    monkeypatch.setattr(MetricsLogger, "close", close_fails)
    caplog.set_level(logging.WARNING, logger="hacrl_megatron")
    with pytest.raises(OutOfSpaceError, match="no space left on .*checkpoints, needed ~1.0 MB"):
        loop.train(exp)
    assert "while stopping after OutOfSpaceError" in caplog.text and "also failed: [Errno 28]" in caplog.text
    shutil.rmtree(exp.output_dir)
    capsys.readouterr()
    assert main(["train", "--preset", preset_file(tmp_path, exp)]) == 1  # the CLI: one line, exit 1
    err = capsys.readouterr().err
    assert "hacrl: no space left on" in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------
# metrics.jsonl


ROWS = [{"step": 1, "a/reward_mean": 0.5}, {"step": 2, "a/reward_mean": 0.25}]


def test_injected_enospc_mid_row_leaves_no_torn_line(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(path)
    for row in ROWS:
        writer.write(row)
    intact = path.read_bytes()

    def half_then_full(fd, data):
        metrics_mod.os.write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics_mod, "_write_all", half_then_full)
    with pytest.raises(OutOfSpaceError, match=f"no space left on {tmp_path}, needed ~"):
        writer.write({"step": 3, "a/reward_mean": 1.0})
    writer.close()
    assert path.read_bytes() == intact


def test_full_tmpfs_mid_row_leaves_no_torn_line(small_tmpfs):
    path = small_tmpfs / "metrics.jsonl"
    writer = JsonlWriter(path)
    writer.write(ROWS[0])
    intact = path.read_bytes()
    fill(small_tmpfs)
    with pytest.raises(OutOfSpaceError, match=f"no space left on {small_tmpfs}"):
        writer.write({"step": 2, "pad": "x" * 20000})  # larger than the slack of the file's last page
    assert path.read_bytes() == intact
    free_space(small_tmpfs)
    writer.write(ROWS[1])
    writer.close()
    assert read_metrics(path) == ROWS


def test_torn_last_line_is_repaired_when_the_run_resumes(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + '{"step": 3, "a/rew')  # killed mid-row
    caplog.set_level(logging.WARNING, logger="hacrl_megatron")
    writer = JsonlWriter(path)
    assert "removed a torn last line (line 3, 18 bytes)" in caplog.text
    writer.write({"step": 3, "a/reward_mean": 1.0})
    writer.close()
    rows, skipped = read_metrics_lines(path)
    assert [r["step"] for r in rows] == [1, 2, 3] and skipped == []


def test_readers_skip_a_torn_line_and_report_its_number(tmp_path, caplog, capsys):
    run = tmp_path / "run"
    run.mkdir()
    path = run / "metrics.jsonl"
    torn = '{"step": 2, "a/rew' + json.dumps({"step": 3, "a/reward_mean": 1.0}) + "\n"  # a torn row merged
    path.write_text(json.dumps(ROWS[0]) + "\n" + torn + json.dumps({"step": 4, "a/reward_mean": 0.0}) + "\n")
    caplog.set_level(logging.WARNING, logger="hacrl_megatron")
    assert [r["step"] for r in read_metrics(path)] == [1, 4]
    assert f"{path} line 2: not a metrics row" in caplog.text
    plot_metrics = load_tool("plot_metrics")
    assert plot_metrics.main([str(run), "--out", str(tmp_path / "p.png"), "--keys", "reward_mean"]) == 0
    assert f"warning: {path} line 2: not a metrics row" in capsys.readouterr().err
    assert (tmp_path / "p.png").stat().st_size > 0
