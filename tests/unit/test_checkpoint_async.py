"""The run's checkpoint writing on stand-in agents (no model): saves that start together, a checkpoint
that is visible only once finished, pruning after the finish, a failed run's save in flight, and the
hashing file the writers write through (its digest is hashlib's over the file)."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import types
from pathlib import Path

import pytest
import torch

from hacrl_megatron.agents.checkpoint_io import (
    BackgroundWrite,
    DigestMismatchError,
    HashingWriter,
    read_verified,
    write_bytes,
)
from hacrl_megatron.trainer import checkpoint as ckpt
from hacrl_megatron.trainer.run_checkpoints import RunCheckpoints


class StandIn:
    """An agent whose save writes one file through a HashingWriter in a writer thread. ``gate``: a barrier
    every agent's begin_save must reach (proves the saves begin at once); ``release``: an event the
    writer waits for (keeps the save in flight)."""

    def __init__(self, payload: bytes, remote: bool = False, gate: threading.Barrier | None = None,
                 release: threading.Event | None = None) -> None:
        self.payload, self.runs_in_process, self.gate, self.release = payload, not remote, gate, release
        self.pending: BackgroundWrite | None = None

    def begin_save(self, path: str, background: bool = False) -> None:
        if self.gate is not None:
            self.gate.wait(timeout=30)  # BrokenBarrierError when the other agent's save has not begun meanwhile

        def job(abort):
            if self.release is not None:
                assert self.release.wait(timeout=30)
            return {"w.bin": write_bytes(Path(path) / "w.bin", self.payload, abort)}

        self.pending = BackgroundWrite(job, "stand-in")

    def end_save(self) -> dict:
        pending, self.pending = self.pending, None
        return pending.result()


def runtimes(*agents):
    return [types.SimpleNamespace(name=f"a{i}", trainer=agent) for i, agent in enumerate(agents)]


def test_hashing_writer_digest_is_hashlib_over_the_file_and_it_writes_sequentially(tmp_path):
    path = tmp_path / "f.bin"
    with HashingWriter(path) as f:
        torch.save({"x": torch.arange(1000)}, f)  # torch's zip writer, as state.pt and optimizer.pt use it
        f.write(memoryview(b"tail"))
        with pytest.raises(OSError, match="writes sequentially"):
            f.seek(0)
    data = path.read_bytes()
    assert f.digest == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert torch.equal(torch.load(io.BytesIO(data[:-4]), weights_only=True)["x"], torch.arange(1000))
    assert read_verified(path, f.digest) == data
    flipped = bytearray(data)
    flipped[10] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(DigestMismatchError, match=r"f\.bin does not match its SHA-256"):
        read_verified(path, f.digest)


def test_remote_agents_begin_their_saves_at_once(tmp_path):
    gate = threading.Barrier(2)
    rts = runtimes(StandIn(b"a" * 100, remote=True, gate=gate), StandIn(b"b" * 50, remote=True, gate=gate))
    final = ckpt.save_checkpoint(tmp_path, 1, rts, {"history": {}})
    files = json.loads((final / ckpt.MANIFEST).read_text())["files"]
    for rel in ("agents/a0/w.bin", "agents/a1/w.bin", "state.pt"):
        assert files[rel]["sha256"] == hashlib.sha256((final / rel).read_bytes()).hexdigest()


def test_a_checkpoint_in_flight_is_invisible_and_the_old_one_is_pruned_only_after_its_finish(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, runtimes(StandIn(b"one")), {"history": {}}, keep=1)
    release = threading.Event()
    saves = RunCheckpoints(tmp_path, keep=1, background=True)
    saves.save(2, runtimes(StandIn(b"two", release=release)), {"history": {}})
    assert saves.pending is not None  # the write waits for release: the save is in flight
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000001"
    assert ckpt.find_resume_checkpoint(tmp_path).name == "step-000001"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000001"]
    release.set()
    assert saves.finish() == tmp_path / "step-000002"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002"]  # keep=1, pruned now
    assert ckpt.verify_checkpoint(tmp_path / "step-000002") and saves.take_wait_s() > 0
    assert saves.take_wait_s() is None


@pytest.mark.parametrize("failure, finished", [(RuntimeError("a step failed"), True), (KeyboardInterrupt(), False)])
def test_a_failed_runs_save_in_flight_is_finished_after_an_error_and_abandoned_when_interrupted(
        tmp_path, failure, finished):
    ckpt.save_checkpoint(tmp_path, 1, runtimes(StandIn(b"one")), {"history": {}})
    saves = RunCheckpoints(tmp_path, keep=2, background=True)
    saves.save(2, runtimes(StandIn(b"two")), {"history": {}})
    saves.settle(failure)
    assert saves.pending is None
    assert ckpt.find_resume_checkpoint(tmp_path).name == ("step-000002" if finished else "step-000001")
    assert list(tmp_path.glob(".tmp-*")) == []


def test_write_manifest_takes_the_writers_digests_and_hashes_only_the_files_they_do_not_list(tmp_path, monkeypatch):
    folder = tmp_path / "c"
    (folder / "agents" / "a").mkdir(parents=True)
    listed = {"agents/a/w.bin": write_bytes(folder / "agents" / "a" / "w.bin", b"x" * 4096)}
    (folder / "agents" / "a" / "metadata.json").write_text("{}")
    read_back = []
    real = ckpt._sha256
    monkeypatch.setattr(ckpt, "_sha256", lambda p: (read_back.append(Path(p).name), real(p))[1])
    ckpt.write_manifest(folder, 1, listed)
    assert read_back == ["metadata.json"]
    assert ckpt.verify_checkpoint(folder)
    with pytest.raises(RuntimeError, match="4096 bytes on disk, its writer wrote 4097"):  # a writer's digest must match the disk
        ckpt.write_manifest(folder, 1, {"agents/a/w.bin": {"size": 4096 + 1, "sha256": "0" * 64}})
