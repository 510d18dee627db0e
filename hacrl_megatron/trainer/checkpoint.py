"""Joint, atomic, verified checkpoints of a whole HACRL run.

Layout of ``<dir>/step-000020/``: ``agents/<name>/`` (each AgentHandle's own save), ``state.pt``
(step, data position, capability tracker, RNG states), ``MANIFEST.json`` (size and SHA-256 of
every file) and ``COMPLETE`` (written last; it holds the manifest's own SHA-256).

Writing: everything goes to ``<dir>/.tmp-step-000020-<pid>/``; every file and folder is fsynced,
then the manifest, then the marker, and the folder is renamed into place (and the parent fsynced).
A run killed mid-save leaves the previous checkpoint and a temp folder that the next save removes;
a save that fails (a full disk) removes its temp folder at once and says how much space it needed.

Reading: :func:`find_resume_checkpoint` verifies the newest checkpoint against its manifest and
falls back to the newest one that verifies, logging why a newer one was skipped and moving it
aside to ``damaged-step-…`` (kept for inspection, never pruned); :func:`resume_from` treats damage
found only while loading (another model size, other agents, a planted pickle in `state.pt`)
the same way, and refuses to resume — rather than restart at step 0 over the run's metrics and
``final/`` — when no checkpoint is left that loads. ``state.pt`` is read with
``torch.load(weights_only=True)``: it holds only tensors and plain Python values, so a planted file
cannot run code (older checkpoints stored numpy's RNG state as an array: the few numpy types that
needs are allow-listed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hacrl_megatron.agents.checkpoint import DamagedCheckpointError
from hacrl_megatron.durable import (
    OutOfSpaceError,
    free_bytes,
    fsync_dir,
    fsync_file,
    is_out_of_space,
    megabytes,
)
from hacrl_megatron.errors import InputError, Terminated, one_line_text

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"
_HASH_THREADS = 8  # hashlib releases the GIL: large checkpoints hash in parallel


def _name(step: int) -> str:
    return f"step-{step:06d}"


# --------------------------------------------------------------------------------------------
# RNG state as plain values (loadable with weights_only=True)


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


def load_state_file(path: Path) -> dict[str, Any]:
    """``state.pt`` without unpickling arbitrary objects (weights_only + the numpy allow-list)."""
    with torch.serialization.safe_globals(_legacy_numpy_globals()):
        try:
            return torch.load(path, weights_only=True)
        except Exception as err:  # UnpicklingError for a forbidden type, RuntimeError for a damaged zip
            raise DamagedCheckpointError(f"{path}: cannot be read as a run state "
                                         f"(damaged, or holds objects other than tensors and plain values): {err}") from err


# --------------------------------------------------------------------------------------------
# manifest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MARKER, MANIFEST))


def _hash_all(folder: Path, rels: list[str]) -> list[str]:
    with ThreadPoolExecutor(min(_HASH_THREADS, max(1, len(rels)))) as pool:
        return list(pool.map(lambda rel: _sha256(folder / rel), rels))


def write_manifest(folder: Path, step: int) -> None:
    """fsync every file and folder under ``folder``, then write the manifest and the marker durably."""
    rels = [p.relative_to(folder).as_posix() for p in _files(folder)]
    for rel in rels:
        fsync_file(folder / rel)
    for sub in sorted({(folder / rel).parent for rel in rels}, key=lambda p: -len(p.parts)):
        fsync_dir(sub)
    digests = _hash_all(folder, rels)
    files = {rel: {"size": (folder / rel).stat().st_size, "sha256": d} for rel, d in zip(rels, digests)}
    text = json.dumps({"format": 1, "step": step, "files": files}, indent=1, sort_keys=True).encode()
    for name, data in ((MANIFEST, text), (MARKER, f"{step}\nmanifest-sha256 {hashlib.sha256(text).hexdigest()}\n".encode())):
        with open(folder / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(folder)


def verify_checkpoint(path: str | os.PathLike) -> bool:
    """Check ``path`` against its manifest; raise :class:`DamagedCheckpointError` saying what is wrong.

    Returns False (after a warning) for a checkpoint written before manifests existed, True when verified.
    """
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        raise DamagedCheckpointError(f"{path}: no {MARKER} marker (the save did not finish)")
    lines = marker.read_text(errors="replace").split("\n")
    expected = next((ln.split()[1] for ln in lines if ln.startswith("manifest-sha256 ") and len(ln.split()) == 2), None)
    if expected is None and (path / MANIFEST).exists():  # a manifest is written before its marker, never after
        raise DamagedCheckpointError(f"{path}: {MARKER} holds no checksum of the {MANIFEST} beside it (damaged marker)")
    if expected is None:
        logger.warning("%s: written before checkpoints had a manifest: not verified", path)
        return False
    try:
        text = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise DamagedCheckpointError(f"{path}: {MANIFEST} is missing") from None
    if hashlib.sha256(text).hexdigest() != expected:
        raise DamagedCheckpointError(f"{path}: {MANIFEST} does not match its checksum in {MARKER}")
    files = json.loads(text)["files"]
    for rel, want in files.items():
        f = path / rel
        if not f.is_file():
            raise DamagedCheckpointError(f"{path}: {rel} is missing")
        size = f.stat().st_size
        if size != want["size"]:
            raise DamagedCheckpointError(f"{path}: {rel} is {size} bytes, the manifest says {want['size']} (truncated?)")
    for rel, digest in zip(files, _hash_all(path, list(files))):
        if digest != files[rel]["sha256"]:
            raise DamagedCheckpointError(f"{path}: {rel} does not match its SHA-256 in {MANIFEST} (corrupted)")
    return True


# --------------------------------------------------------------------------------------------
# save


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def save_checkpoint(root: str | os.PathLike, step: int, runtimes, state: dict[str, Any], keep: int = 2) -> Path:
    """Write every agent and the run ``state`` for ``step`` atomically; keep the newest ``keep``.

    Raises :class:`OutOfSpaceError` ("no space left on <root>, needed ~N MB") when the disk fills;
    the partly written temp folder is removed either way.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / _name(step)
    tmp = root / f".tmp-{_name(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for rt in runtimes:
            rt.trainer.save(str(tmp / "agents" / rt.name))
        torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
        write_manifest(tmp, step)
    except BaseException as err:  # torch's distributed-checkpoint writer raises a BaseException subclass
        interrupted = isinstance(err, (KeyboardInterrupt, SystemExit, Terminated))  # Ctrl-C, SIGTERM, exit
        written, full = _tree_bytes(tmp), not interrupted and is_out_of_space(err, root)
        if interrupted:
            _remove_until_it_stays_gone(tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise _out_of_space(root, step, written) from err
        raise
    if final.exists():  # re-saving the same step (e.g. after a resume): replace the old one
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    _prune(root, keep)
    logger.debug("checkpoint written: %s", final)
    return final


def _remove_until_it_stays_gone(tmp: Path, settle_s: float = 1.0, limit_s: float = 10.0) -> None:
    """Remove an interrupted save's temp folder for good. The signal that interrupted this process (Ctrl-C to
    the terminal's process group, Slurm's scancel to every process of the step) also reaches the writers
    megatron's checkpoint forks; one may still create a file in ``tmp`` just after a first removal, so
    ``tmp`` is removed again until it has stayed gone ``settle_s`` seconds (at most ``limit_s`` in all)."""
    deadline = time.monotonic() + limit_s
    shutil.rmtree(tmp, ignore_errors=True)
    gone_since = time.monotonic()
    while time.monotonic() - gone_since < settle_s and time.monotonic() < deadline:
        time.sleep(0.05)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            gone_since = time.monotonic()


def _out_of_space(root: Path, step: int, written: int) -> OutOfSpaceError:
    previous = latest_checkpoint(root)
    if previous is not None:
        need = f"needed ~{megabytes(_tree_bytes(previous))} MB (the size of {previous.name})"
    else:
        need = f"needed more than ~{megabytes(written)} MB (written before the disk filled)"
    return OutOfSpaceError(f"no space left on {root}, {need}, {megabytes(free_bytes(root))} MB free: checkpoint "
                           f"{_name(step)} not written; its temp folder was removed, the previous checkpoint is intact")


def _prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob("step-*") if (p / MARKER).exists())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid != str(os.getpid()):  # a temp folder of a crashed run (the run folder lock rules out a live one)
            shutil.rmtree(stale, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# find and load


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint under ``root`` with a ``COMPLETE`` marker (not verified; None when there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    complete = sorted(p for p in root.glob("step-*") if (p / MARKER).exists())
    return complete[-1] if complete else None


def find_resume_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint under ``root`` that verifies against its manifest (None when none does).

    A newer one that fails is logged with the reason and renamed to ``damaged-step-…`` so that
    neither a later resume nor the pruning of old checkpoints counts it.
    """
    root = Path(root)
    while (path := latest_checkpoint(root)) is not None:
        try:
            verify_checkpoint(path)
            return path
        except DamagedCheckpointError as err:
            logger.warning("skipping damaged checkpoint: %s; moved to %s, trying the previous one", err,
                           _move_aside(path).name)
    return None


class ResumeError(InputError):
    """``checkpoint.resume=true`` finds checkpoints but none it can continue from; the message names the
    folder (``hacrl`` exits 2: restarting at step 0 would re-log steps and overwrite ``final/``)."""


def _one_line(err: BaseException, limit: int = 300) -> str:
    return one_line_text(str(err), limit) or type(err).__name__  # torch's size-mismatch errors span lines


def _move_aside(path: Path) -> Path:
    aside = path.parent / f"damaged-{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    os.replace(path, aside)
    return aside


def resume_from(root: str | os.PathLike, load: Callable[[Path], dict[str, Any]]) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint under ``root`` that verifies *and* loads: ``(path, load(path))``.

    ``load`` restores the run from a checkpoint (:func:`load_checkpoint`); damage it finds (another
    model size, other agents, a planted pickle) is handled like damage the manifest finds: the
    checkpoint is logged, moved aside to ``damaged-step-…`` and the previous one is tried. Returns
    None when ``root`` holds no checkpoint at all. Raises :class:`ResumeError` when the only checkpoint
    left cannot be loaded (it stays in place), or when every checkpoint was damaged.
    """
    root = Path(root)
    while (path := find_resume_checkpoint(root)) is not None:
        try:
            return path, load(path)
        except Exception as err:  # any failure to restore: the checkpoint is not one this run can continue
            logger.debug("loading %s failed", path, exc_info=True)
            older = [p for p in root.glob("step-*") if (p / MARKER).exists() and p.name < path.name]
            if not older:
                raise ResumeError(f"checkpoint {path} cannot be loaded into this run ({_one_line(err)}) and no "
                                  f"older checkpoint is left in {root}; nothing was changed") from None
            logger.warning("skipping checkpoint that cannot be loaded: %s: %s; moved to %s, trying the previous one",
                           path, _one_line(err), _move_aside(path).name)
    damaged = sorted(p.name for p in root.glob("damaged-step-*")) if root.is_dir() else []
    if damaged:
        raise ResumeError(f"checkpoint.resume=true: no checkpoint in {root} can be resumed, every one is damaged "
                          f"({', '.join(damaged)}); starting over would re-log steps and overwrite final/: remove "
                          "the damaged-step-* folders to start this run again, or use another output_dir")
    return None


def load_checkpoint(path: str | os.PathLike, runtimes) -> dict[str, Any]:
    """Restore every agent from ``path`` and return the run state (RNG states already applied)."""
    path = Path(path)
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {MARKER} marker)")
    agents_dir = path / "agents"
    saved = sorted(p.name for p in agents_dir.iterdir()) if agents_dir.is_dir() else []
    names = sorted(rt.name for rt in runtimes)
    if saved != names:
        raise ValueError(f"{path}: checkpoint holds agents {saved}, this run has {names}")
    state = load_state_file(path / "state.pt")  # read first: a bad file fails before any agent changes
    named = path.name[len("step-"):]
    folder_step = int(named) if path.name.startswith("step-") and named.isdigit() else None
    if not isinstance(state, dict):
        raise DamagedCheckpointError(f"{path}: state.pt holds a {type(state).__name__}, not a run state")
    if folder_step is not None and state.get("step") != folder_step:
        raise DamagedCheckpointError(f"{path}: state.pt holds step {state.get('step')!r}, not the folder's step "
                                     f"{folder_step} (a run state from elsewhere)")
    for rt in runtimes:
        rt.trainer.load(str(agents_dir / rt.name))
    set_rng_state(state["rng"])
    return state
