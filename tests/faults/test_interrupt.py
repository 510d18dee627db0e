"""Ctrl-C and SIGTERM: `hacrl train` exits 130 (SIGINT) or 143 (SIGTERM, a scheduler's stop) with one
line naming the last checkpoint, without a traceback, and leaves a folder the next run can resume from."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from hacrl_megatron.cli import main
from hacrl_megatron.errors import Terminated
from hacrl_megatron.trainer import loop
from hacrl_megatron.trainer.checkpoint import find_resume_checkpoint, save_checkpoint
from hacrl_megatron.trainer.metrics import read_metrics
from hacrl_megatron.trainer.run_folder import checkpoint_dir
from tests.faults.trainer_helpers import exp_with, preset_file, tiny


def test_ctrl_c_exits_130_with_one_line_naming_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    exp = tiny(tmp_path, steps=4, every=2)
    root = checkpoint_dir(exp)

    def interrupted_after_two_checkpoints(cfg):
        for step in ("step-000002", "step-000004"):
            (root / step).mkdir(parents=True)
            (root / step / "COMPLETE").write_text(step[-1])
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train", interrupted_after_two_checkpoints)
    assert main(["train", "--preset", preset_file(tmp_path, exp)]) == 130
    err = capsys.readouterr().err
    assert err == (f"hacrl: interrupted; last checkpoint: {root / 'step-000004'} "
                   "(continue with checkpoint.resume=true)\n")


def test_ctrl_c_before_the_first_checkpoint_says_so(tmp_path, monkeypatch, capsys):
    exp = tiny(tmp_path)

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train", interrupted)
    assert main(["train", "--preset", preset_file(tmp_path, exp)]) == 130
    root = checkpoint_dir(exp)
    assert capsys.readouterr().err == f"hacrl: interrupted; no checkpoint written yet in {root}\n"


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, Terminated])
def test_an_interrupted_save_leaves_no_temp_folder_even_when_a_writer_adds_a_file_after_it(tmp_path, interrupt):
    """Slurm's scancel signals every process of the step, megatron's forked checkpoint writers included: one
    may still write into the temp folder just after the interrupted save removed it. The folder is removed
    again until it stays gone; the previous checkpoint is untouched."""
    root = tmp_path / "checkpoints"
    (root / "step-000001").mkdir(parents=True)
    (root / "step-000001" / "COMPLETE").write_text("x")
    late = []

    class LateWriter:
        def begin_save(self, path, background=False):
            Path(path).mkdir(parents=True, exist_ok=True)

            def write_after_the_removal():
                time.sleep(0.3)
                Path(path).mkdir(parents=True, exist_ok=True)
                (Path(path) / "__0_0.distcp").write_bytes(b"shard")
                late.append(path)

            threading.Thread(target=write_after_the_removal).start()
            raise interrupt

    runtime = types.SimpleNamespace(name="llama", trainer=LateWriter())
    with pytest.raises(interrupt):
        save_checkpoint(root, 2, [runtime], {})
    assert late  # the writer did write after the removal began
    assert sorted(p.name for p in root.iterdir()) == ["step-000001"]


def _sleep_in_child():
    time.sleep(60)


def test_a_forked_child_ends_silently_on_sigterm_and_the_parent_still_raises(capfd):
    """A child forked after `hacrl` installed its SIGTERM handler (a checkpoint writer, a verifier worker) dies
    the default way, without a Terminated traceback; the installing process still raises Terminated."""
    import multiprocessing

    from hacrl_megatron import cli

    cli._SIGTERM_OWNER["pid"] = os.getpid()
    previous = signal.signal(signal.SIGTERM, cli._on_sigterm)
    try:
        child = multiprocessing.get_context("fork").Process(target=_sleep_in_child)
        child.start()
        time.sleep(0.5)
        os.kill(child.pid, signal.SIGTERM)
        child.join(30)
        assert child.exitcode == -signal.SIGTERM
        assert "Terminated" not in capfd.readouterr().err
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
def test_real_sigint_to_a_running_train_process(tmp_path):
    """SIGINT to the whole process group, as a terminal's Ctrl-C does (verifier workers included)."""
    exp = exp_with(tiny(tmp_path, steps=500, every=1), train={"verifier_workers": 1})
    root = checkpoint_dir(exp)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "hacrl_megatron", "train", "--preset", preset_file(tmp_path, exp)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 300
        # any complete checkpoint from step 2 on: with checkpoint.keep the run may prune step 2 between polls
        while not any(int(c.parent.name[-6:]) >= 2 for c in root.glob("step-*/COMPLETE")):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"hacrl: interrupted; last checkpoint: {root}/step-")
    named = Path(last.split("last checkpoint: ")[1].split(" ")[0])
    assert named == find_resume_checkpoint(root) and list(root.glob(".tmp-*")) == []
    resumed = loop.train(exp_with(exp, train={"steps": int(named.name[-6:]) + 1}, checkpoint={"resume": True}))
    assert resumed.step == int(named.name[-6:]) + 1
    assert read_metrics(Path(exp.output_dir) / "metrics.jsonl")[-1]["step"] == resumed.step


SIGTERM_DURING_TRAIN = """
import os, signal, sys, time
from pathlib import Path
from hacrl_megatron.cli import main
from hacrl_megatron.trainer import loop

def train(cfg):  # a run that has written step 2, then gets the scheduler's SIGTERM
    root = Path(sys.argv[2])
    (root / "step-000002").mkdir(parents=True)
    (root / "step-000002" / "COMPLETE").write_text("2")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)

loop.train = train
sys.exit(main(["train", "--preset", sys.argv[1]]))
"""


def test_sigterm_exits_143_with_one_line_naming_the_last_checkpoint(tmp_path):
    exp = tiny(tmp_path)
    root = checkpoint_dir(exp)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", SIGTERM_DURING_TRAIN, preset_file(tmp_path, exp), str(root)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 143, done.stderr
    assert done.stderr == (f"hacrl: terminated (SIGTERM); last checkpoint: {root / 'step-000002'} "
                           "(continue with checkpoint.resume=true)\n")


@pytest.mark.slow
def test_real_sigterm_to_a_running_train_process(tmp_path):
    """SIGTERM to the whole process group, as Slurm does at scancel or the time limit."""
    exp = exp_with(tiny(tmp_path, steps=500, every=1), train={"verifier_workers": 1})
    root = checkpoint_dir(exp)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "hacrl_megatron", "train", "--preset", preset_file(tmp_path, exp)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while not any(int(c.parent.name[-6:]) >= 2 for c in root.glob("step-*/COMPLETE")):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"hacrl: terminated (SIGTERM); last checkpoint: {root}/step-")
    named = Path(last.split("last checkpoint: ")[1].split(" ")[0])
    assert named == find_resume_checkpoint(root) and list(root.glob(".tmp-*")) == []
