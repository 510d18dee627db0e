"""A run's state in a checkpoint (``state.pt``): RNG states as plain values, read without unpickling code.

``state.pt`` is read with ``torch.load(weights_only=True)``: it holds only tensors and plain Python
values, so a planted file cannot run code (older checkpoints stored numpy's RNG state as an array:
the few numpy types that needs are allow-listed).
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hacrl_megatron.agents.checkpoint_io import DamagedCheckpointError, FileDigest, read_verified


def rng_state() -> dict[str, Any]:
    name, key, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": (name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached))}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, key, pos, has_gauss, cached = state["numpy"]
    key = key.numpy() if isinstance(key, torch.Tensor) else key
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))


def _legacy_numpy_globals() -> list:
    """The numpy types an older ``state.pt`` (numpy RNG state as an array) needs, and nothing else."""
    return [np.zeros(1).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_state_file(path: Path, expected: FileDigest | None = None) -> dict[str, Any]:
    """``state.pt`` without unpickling arbitrary objects (weights_only + the numpy allow-list); read once
    and checked against ``expected`` (its manifest entry; None: unchecked) before it is parsed."""
    data = read_verified(path, expected)
    with torch.serialization.safe_globals(_legacy_numpy_globals()):
        try:
            return torch.load(io.BytesIO(data), weights_only=True)
        except Exception as err:  # UnpicklingError for a forbidden type, RuntimeError for a damaged zip
            raise DamagedCheckpointError(f"{path}: cannot be read as a run state "
                                         f"(damaged, or holds objects other than tensors and plain values): {err}") from err
