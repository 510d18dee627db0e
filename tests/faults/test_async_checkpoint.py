"""Asynchronous checkpoints (``checkpoint.async_save``) on the tiny two-agent run.

* an async save, with a training step between its start and its finish, writes the same content as a
  synchronous save of that step (the writer works on a copy), loads, and its manifest holds each
  file's hashlib SHA-256, computed as the file was written (no tensor file is read back);
* kill -9 while an async save is in flight (its writer held by a test hook until the kill): the run
  resumes from the previous complete checkpoint and its losses equal an unbroken run's.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hacrl_megatron.agents import checkpoint_io
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.trainer import checkpoint as ckpt
from hacrl_megatron.trainer import loop
from hacrl_megatron.trainer.metrics import read_metrics
from hacrl_megatron.trainer.run_folder import checkpoint_dir
from tests.e2e.test_trainer import parity_reward
from tests.faults.trainer_helpers import exp_with, preset_file, start, tiny

ROOT = Path(__file__).resolve().parents[2]
SMALL_METADATA = {"common.pt", ".metadata", "metadata.json"}  # written by megatron / torch by path
AGENTS = ("llama", "qwen3")


def exported(run) -> dict[str, dict[str, torch.Tensor]]:
    return {rt.name: {k: v.clone() for k, v in rt.trainer.export_hf_weights()} for rt in run.runtimes}


def manifest(folder: Path) -> dict[str, dict]:
    return json.loads((folder / ckpt.MANIFEST).read_text())["files"]


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_an_async_save_writes_what_a_sync_save_writes_hashed_as_written(tmp_path, monkeypatch, backend):
    exp = tiny(tmp_path, backend=backend, steps=2, every=1)
    run = start(exp)
    read_back = []
    real_hash_file = checkpoint_io.hash_file
    monkeypatch.setattr(checkpoint_io, "hash_file", lambda p: (read_back.append(Path(p).name), real_hash_file(p))[1])
    try:
        loop.train_step(run)
        weights = exported(run)
        state = {"history": {}}
        sync = ckpt.save_checkpoint(tmp_path / "sync", 1, run.runtimes, state)
        pending = ckpt.begin_checkpoint(tmp_path / "async", 1, run.runtimes, state, background=True)
        loop.train_step(run)  # the weights and the optimizer state change while the writers write
        assert ckpt.latest_checkpoint(tmp_path / "async") is None  # not finished: nothing to resume from yet
        done = pending.finish()
    finally:
        for rt in run.runtimes:
            rt.close()
    assert set(read_back) <= SMALL_METADATA  # every tensor file, state.pt and the HF files were hashed as written
    a, b = manifest(sync), manifest(done)
    assert set(a) == set(b)
    for rel, entry in b.items():
        data = (done / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
        if not rel.endswith(".metadata"):  # torch's .metadata holds a fresh save id
            assert entry == a[rel], f"{rel} differs between the sync and the async save"
    fresh = start(exp)
    try:
        assert ckpt.load_checkpoint(done, fresh.runtimes)["step"] == 1
        for name, tensors in exported(fresh).items():
            for key, value in tensors.items():
                assert torch.equal(value, weights[name][key]), f"{name}.{key}"
    finally:
        for rt in fresh.runtimes:
            rt.close()


KILLED_RUN = """
import sys
from hacrl_megatron.config import load_config
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.trainer import loop
from tests.e2e.test_trainer import parity_reward

built = loop.setup

def setup(exp, *args):  # the parity verifier in-process, as the unbroken run has it
    run = built(exp, *args)
    run.verifier.close()
    run.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
    return run

loop.setup = setup
loop.train(load_config(sys.argv[1]))
"""


def with_parity_verifier(monkeypatch) -> None:
    built = loop.setup

    def setup(exp, *args):
        run = built(exp, *args)
        run.verifier.close()
        run.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
        return run

    monkeypatch.setattr(loop, "setup", setup)


def losses(folder: Path) -> dict[int, dict[str, float]]:
    rows = {r["step"]: r for r in read_metrics(folder / "metrics.jsonl")}
    return {step: {f"{n}/hacpo/loss": r[f"{n}/hacpo/loss"] for n in AGENTS} for step, r in rows.items()}


def test_kill_9_during_an_async_save_resumes_from_the_previous_complete_checkpoint(tmp_path, monkeypatch):
    exp = tiny(tmp_path / "killed", backend="megatron", steps=6, every=2, checkpoint={"async_save": True})
    release = tmp_path / "release"
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           checkpoint_io.HOLD_MATCH: "*step-000004-*/agents/*.distcp", checkpoint_io.HOLD_RELEASE: str(release)}
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, preset_file(tmp_path, exp)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not Path(f"{release}.held").exists():  # step 4's writer has written its first bytes and waits
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the step-4 save did not start within 600 s"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9 of the whole job, mid-save
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    root = checkpoint_dir(exp)
    assert (root / "step-000002" / ckpt.MARKER).exists() and not (root / "step-000004").exists()
    assert list(root.glob(".tmp-step-000004-*"))  # the save in flight: written in part, never made complete
    assert ckpt.find_resume_checkpoint(root).name == "step-000002"

    with_parity_verifier(monkeypatch)
    resumed = loop.train(exp_with(exp, checkpoint={"resume": True}))
    assert resumed.step == 6 and list(root.glob(".tmp-*")) == []
    assert ckpt.verify_checkpoint(root / "step-000006")
    unbroken = tiny(tmp_path / "unbroken", backend="megatron", steps=6, every=2)  # synchronous saves on CPU
    loop.train(unbroken)
    got, want = losses(Path(exp.output_dir)), losses(Path(unbroken.output_dir))
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    assert any(value != 0 for row in want.values() for value in row.values())  # real updates (parity rewards)
    for step in range(1, 7):
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
