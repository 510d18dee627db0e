"""Joint, atomic checkpoints of a whole HACRL run.

Layout of ``<dir>/step-000020/``: ``agents/<name>/`` (each AgentHandle's own save), ``state.pt``
(step, data position, capability tracker, RNG states) and ``COMPLETE`` (written last). A
checkpoint is first written to ``<dir>/.tmp-step-000020-<pid>/`` and renamed into place, so a run
killed mid-save leaves either the previous complete checkpoint or an ignored temp folder;
``latest_checkpoint`` only returns folders with ``COMPLETE``.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"


def _name(step: int) -> str:
    return f"step-{step:06d}"


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_checkpoint(root: str | os.PathLike, step: int, runtimes, state: dict[str, Any], keep: int = 2) -> Path:
    """Write every agent and the run ``state`` for ``step`` atomically; keep the newest ``keep``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / _name(step)
    tmp = root / f".tmp-{_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    for rt in runtimes:
        rt.agent.save(str(tmp / "agents" / rt.name))
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
    (tmp / MARKER).write_text(f"{step}\n")
    if final.exists():  # re-saving the same step (e.g. after a resume): replace the old one
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(root, keep)
    logger.info("checkpoint written: %s", final)
    return final


def _prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob("step-*") if (p / MARKER).exists())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid != str(os.getpid()):  # a temp folder of a crashed run: never complete, safe to drop
            shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (None when there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    complete = sorted(p for p in root.glob("step-*") if (p / MARKER).exists())
    return complete[-1] if complete else None


def load_checkpoint(path: str | os.PathLike, runtimes) -> dict[str, Any]:
    """Restore every agent from ``path`` and return the run state (RNG states already applied)."""
    path = Path(path)
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {MARKER} marker)")
    saved = sorted(p.name for p in (path / "agents").iterdir())
    names = sorted(rt.name for rt in runtimes)
    if saved != names:
        raise ValueError(f"{path}: checkpoint holds agents {saved}, this run has {names}")
    for rt in runtimes:
        rt.agent.load(str(path / "agents" / rt.name))
    state = torch.load(path / "state.pt", weights_only=False)
    set_rng_state(state["rng"])
    return state
