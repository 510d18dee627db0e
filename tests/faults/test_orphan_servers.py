"""`kill -9` of the trainer leaves no engine server behind (rollout/server_guard.py).

Engine servers run in their own session, so nothing but their guard ends them when the trainer is
killed outright: a leaked server keeps its port, its memory and, on a GPU node, its GPUs. Here a real
`hacrl train` run with stand-in SGLang servers (tests/fixtures/fake_sglang_server.py, one per agent)
is killed with SIGKILL after its first step; every server process must be gone within 30 s.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hacrl_megatron.trainer.run_folder import checkpoint_dir
from tests.faults.trainer_helpers import exp_with, preset_file, tiny

ROOT = Path(__file__).resolve().parents[2]
FAKE_SERVER = ROOT / "tests" / "fixtures" / "fake_sglang_server.py"
BOUND_S = 30.0  # the bound: no server left this long after the trainer's death


def processes_with(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``marker``, other than this one."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry))
    return found


def wait_until_none(marker: str, bound: float) -> float:
    """Seconds until no process matches ``marker``; fails naming the survivors after ``bound`` s."""
    t0 = time.monotonic()
    while processes_with(marker):
        if time.monotonic() - t0 > bound:
            left = processes_with(marker)
            for pid in left:  # do not leak them into the rest of the suite
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"{len(left)} server process(es) {left} still ran {bound:.0f} s after kill -9 of the trainer")
        time.sleep(0.2)
    return time.monotonic() - t0


def kill_trainer_after(proc: subprocess.Popen, checkpoints: Path, marker: str, expect: int, within: float = 600) -> None:
    """Wait until a first checkpoint is under ``checkpoints`` (a step done: any ``step-*`` folder, since with
    checkpoint.every=1 and keep=1 step 1's is gone once step 2's is written, possibly between two looks) and
    ``expect`` server processes run, then SIGKILL the trainer alone."""
    deadline = time.monotonic() + within
    while not (any(checkpoints.glob("step-*")) and len(processes_with(marker)) >= expect):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no checkpoint under {checkpoints} within {within:.0f} s"
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)  # the trainer only: its servers are in sessions of their own
    proc.wait()


@pytest.mark.slow
def test_kill_9_of_the_trainer_leaves_no_stand_in_sglang_server(tmp_path):
    exp = tiny(tmp_path, steps=500, every=1)
    command = [sys.executable, str(FAKE_SERVER), "--model-path", "{model_path}", "--port", "{port}"]
    exp = exp_with(exp, rollout={"engine": "sglang", "sglang": dataclasses.replace(exp.rollout.sglang, command=command)})
    marker = str(tmp_path / "run" / "engines")  # each server's --model-path is under the run's engine folder
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "hacrl_megatron", "train", "--preset", preset_file(tmp_path, exp)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        kill_trainer_after(proc, checkpoint_dir(exp), marker, expect=2)
        took = wait_until_none(marker, BOUND_S)
        print(f"\nevery stand-in server gone {took:.1f} s after kill -9 of the trainer")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
