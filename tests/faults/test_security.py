"""A file planted in a run folder runs no code on resume (``state.pt``, an HF agent's
``optimizer.pt`` are read with ``weights_only=True``); exported HF folders are world-readable."""

from __future__ import annotations

import os
import pickle
import random
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from hacrl_megatron.agents.checkpoint import DamagedCheckpointError
from hacrl_megatron.trainer import checkpoint as ckpt
from hacrl_megatron.trainer import loop
from hacrl_megatron.trainer.run_folder import checkpoint_dir
from tests.faults.trainer_helpers import start, tiny


class Planted:
    """Unpickling this writes a file: stands in for any code an attacker's pickle would run."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return Path.write_text, (self.target, "code ran")


@pytest.fixture
def saved(tmp_path):
    """A one-step tiny run (hf backend) with one checkpoint: (exp, checkpoint folder)."""
    exp = tiny(tmp_path, steps=1, every=1)
    run = start(exp)
    try:
        loop.train_step(run)
        return exp, ckpt.save_checkpoint(checkpoint_dir(exp), 1, run.runtimes, {"history": {}})
    finally:
        for rt in run.runtimes:
            rt.close()


def test_planted_state_pt_runs_no_code(saved, tmp_path):
    exp, folder = saved
    target = tmp_path / "pwned"
    torch.save({"step": 1, "history": Planted(target)}, folder / "state.pt")
    (folder / ckpt.MANIFEST).unlink()  # an attacker can drop the manifest: the marker then reads as pre-manifest
    (folder / ckpt.MARKER).write_text("1\n")
    run = start(exp)
    try:
        with pytest.raises(DamagedCheckpointError, match="state.pt: cannot be read as a run state"):
            ckpt.load_checkpoint(folder, run.runtimes)
    finally:
        for rt in run.runtimes:
            rt.close()
    assert not target.exists()


def test_planted_optimizer_pt_of_an_hf_agent_runs_no_code(saved, tmp_path):
    exp, folder = saved
    target = tmp_path / "pwned"
    agent_dir = folder / "agents" / "llama"
    torch.save({"optimizer": Planted(target), "updates": 1}, agent_dir / "optimizer.pt")
    run = start(exp)
    try:
        with pytest.raises(pickle.UnpicklingError):
            run.runtimes[0].trainer.load(str(agent_dir))
    finally:
        for rt in run.runtimes:
            rt.close()
    assert not target.exists()


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    np.random.rand(5)  # a mid-stream numpy position
    torch.save({"rng": ckpt.rng_state()}, tmp_path / "state.pt")
    expected = (torch.rand(3), random.random(), np.random.rand(3))
    ckpt.set_rng_state(ckpt.load_state_file(tmp_path / "state.pt")["rng"])
    got = (torch.rand(3), random.random(), np.random.rand(3))
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and np.array_equal(got[2], expected[2])


def test_older_state_pt_with_a_numpy_rng_array_still_loads(tmp_path):
    """Checkpoints written before this change pickled numpy's state tuple: the allow-list covers it."""
    np.random.seed(7)
    legacy = {"step": 2, "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                                 "numpy": np.random.get_state()}}
    torch.save(legacy, tmp_path / "state.pt")
    expected = np.random.rand(4)
    ckpt.set_rng_state(ckpt.load_state_file(tmp_path / "state.pt")["rng"])
    assert np.array_equal(np.random.rand(4), expected)


def test_exported_final_folder_is_readable_like_the_rest(tmp_path):
    old = os.umask(0o022)
    try:
        exp = tiny(tmp_path, steps=1, every=0)
        loop.train(exp)
    finally:
        os.umask(old)
    for name in ("llama", "qwen3"):
        folder = Path(exp.output_dir) / "final" / name
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()}
        assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
