"""A damaged newest checkpoint is skipped: the resume falls back to the newest one that verifies
against its manifest, logs why, and continues exactly like the uninterrupted run.

One 4-step reference run per backend (checkpoints at steps 2 and 4) is copied for each case; the
case damages step 4 and resumes, which must land on step 2 and reproduce steps 3-4 of the reference.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from hacrl_megatron.agents.checkpoint import DamagedCheckpointError, check_files
from hacrl_megatron.trainer import checkpoint as ckpt
from hacrl_megatron.trainer.run_folder import checkpoint_dir
from tests.faults.trainer_helpers import resume_and_step, steps_with_checkpoints, tiny


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def first(folder: Path, pattern: str) -> Path:
    return sorted(folder.glob(pattern))[0]


HF_DAMAGE = {  # what is done to step-000004, and the file the skip message must name
    "state.pt truncated": (lambda c: truncate(c / "state.pt"), "state.pt"),
    "agent weights truncated": (lambda c: truncate(first(c / "agents/llama/hf", "*.safetensors")), ".safetensors"),
    "optimizer.pt truncated": (lambda c: truncate(c / "agents/qwen3/optimizer.pt"), "optimizer.pt"),
    "a byte flipped in the weights": (lambda c: flip_byte(first(c / "agents/qwen3/hf", "*.safetensors")),
                                      "does not match its SHA-256"),
    "manifest removed": (lambda c: (c / ckpt.MANIFEST).unlink(), "MANIFEST.json is missing"),
}
MEGATRON_DAMAGE = {
    ".distcp shard truncated": (lambda c: truncate(first(c / "agents/llama", "*.distcp")), ".distcp"),
    "common.pt removed": (lambda c: (c / "agents/qwen3/common.pt").unlink(), "common.pt is missing"),
    ".metadata removed": (lambda c: (c / "agents/llama/.metadata").unlink(), ".metadata is missing"),
    "state.pt truncated": (lambda c: truncate(c / "state.pt"), "state.pt"),
    # same size, other bytes: found by the hash of what the resume loads, naming the file
    "a byte flipped in a .distcp shard": (lambda c: flip_byte(first(c / "agents/llama", "*.distcp")),
                                          ".distcp does not match its SHA-256"),
    "a byte flipped in .metadata": (lambda c: flip_byte(c / "agents/qwen3/.metadata"),
                                    ".metadata does not match its SHA-256"),
    "a byte flipped in common.pt": (lambda c: flip_byte(c / "agents/llama/common.pt"),
                                    "common.pt does not match its SHA-256"),
    "a byte flipped in state.pt": (lambda c: flip_byte(c / "state.pt"), "state.pt does not match its SHA-256"),
}


def reference(tmp_path_factory, backend):
    base = tmp_path_factory.mktemp(f"reference-{backend}")
    history = steps_with_checkpoints(tiny(base, backend=backend, steps=4, every=2), 4)
    return base, history


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    return reference(tmp_path_factory, "hf")


@pytest.fixture(scope="module")
def megatron_reference(tmp_path_factory):
    return reference(tmp_path_factory, "megatron")


def check_fallback(ref, backend, damage, tmp_path, caplog):
    base, history = ref
    shutil.copytree(base / "run", tmp_path / "run")
    exp = tiny(tmp_path, backend=backend, steps=4, every=2)
    root = checkpoint_dir(exp)
    harm, named = damage
    harm(root / "step-000004")
    caplog.set_level(logging.WARNING, logger="hacrl_megatron")
    run, later = resume_and_step(exp, 2)
    try:
        assert run.step == 4 and len(later) == 2
        skip = [r.message for r in caplog.records if "skipping damaged checkpoint" in r.message]
        assert len(skip) == 1 and "step-000004" in skip[0] and named in skip[0]
        assert not (root / "step-000004").exists() and len(list(root.glob("damaged-step-000004-*"))) == 1
        for name in ("llama", "qwen3"):  # resumed from step 2: steps 3-4 repeat the reference exactly
            for a, b in zip(history[2:], later):
                assert a[f"{name}/hacpo/loss"] == pytest.approx(b[f"{name}/hacpo/loss"], rel=1e-6, abs=1e-9)
                assert a[f"{name}/reward_mean"] == b[f"{name}/reward_mean"]
    finally:
        for rt in run.runtimes:
            rt.close()


@pytest.mark.parametrize("case", list(HF_DAMAGE))
def test_damaged_newest_checkpoint_falls_back_hf(hf_reference, case, tmp_path, caplog):
    check_fallback(hf_reference, "hf", HF_DAMAGE[case], tmp_path, caplog)


@pytest.mark.parametrize("case", list(MEGATRON_DAMAGE))
def test_damaged_newest_checkpoint_falls_back_megatron(megatron_reference, case, tmp_path, caplog):
    check_fallback(megatron_reference, "megatron", MEGATRON_DAMAGE[case], tmp_path, caplog)


def test_every_checkpoint_damaged_means_no_checkpoint(hf_reference, tmp_path):
    base, _ = hf_reference
    shutil.copytree(base / "run" / "checkpoints", tmp_path / "ck")
    for step in ("step-000002", "step-000004"):
        truncate(tmp_path / "ck" / step / "state.pt")
    assert ckpt.find_resume_checkpoint(tmp_path / "ck") is None
    assert sorted(p.name[:19] for p in (tmp_path / "ck").iterdir()) == ["damaged-step-000002", "damaged-step-000004"]


def test_manifest_covers_every_file_and_everything_is_synced_before_the_marker(tmp_path, monkeypatch):
    folder = tmp_path / ".tmp-step-000003-1"
    (folder / "agents" / "a").mkdir(parents=True)
    (folder / "agents" / "a" / "w.bin").write_bytes(b"x" * 1000)
    (folder / "agents" / "a" / ".metadata").write_bytes(b"meta")
    (folder / "state.pt").write_bytes(b"state")
    events = []
    monkeypatch.setattr(ckpt, "fsync_file", lambda p: events.append(("file", Path(p).relative_to(folder).as_posix())))
    monkeypatch.setattr(ckpt, "fsync_dir", lambda p: events.append(("dir", Path(p).relative_to(folder).as_posix())))
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fd", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    ckpt.write_manifest(folder, 3)
    files = {e[1] for e in events if e[0] == "file"}
    assert files == {"agents/a/w.bin", "agents/a/.metadata", "state.pt"}
    order = [e[1].rsplit("/", 1)[-1] if e[0] == "fd" else e[0] for e in events]
    assert order.index(ckpt.MANIFEST) < order.index(ckpt.MARKER) and order[-1] == "dir"  # marker last, then the folder
    assert max(i for i, e in enumerate(events) if e[0] == "file") < order.index(ckpt.MANIFEST)
    assert ckpt.verify_checkpoint(folder) is True
    (folder / "agents" / "a" / ".metadata").write_bytes(b"META")  # same size, other bytes
    with pytest.raises(DamagedCheckpointError, match=r"agents/a/.metadata does not match its SHA-256"):
        ckpt.verify_checkpoint(folder)


def test_megatron_checkpoint_files_are_checked_by_name(megatron_reference, tmp_path):
    base, _ = megatron_reference
    agent = tmp_path / "llama"
    shutil.copytree(base / "run" / "checkpoints" / "step-000004" / "agents" / "llama", agent)
    check_files(str(agent))
    (agent / "common.pt").write_bytes(b"")
    with pytest.raises(DamagedCheckpointError, match="common.pt is empty"):
        check_files(str(agent))
    (agent / "common.pt").unlink()
    with pytest.raises(DamagedCheckpointError, match="common.pt is missing"):
        check_files(str(agent))
