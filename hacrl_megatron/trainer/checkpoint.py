"""Joint, atomic, verified checkpoints of a whole HACRL run.

Layout of ``<dir>/step-000020/``: ``agents/<name>/`` (each AgentHandle's own save), ``state.pt``
(step, data position, capability tracker, RNG states), ``MANIFEST.json`` (size and SHA-256 of
every file) and ``COMPLETE`` (written last; it holds the manifest's own SHA-256).

Writing (:func:`begin_checkpoint`, :meth:`PendingCheckpoint.finish`; :func:`save_checkpoint` is both):
everything goes to ``<dir>/.tmp-step-000020-<pid>/``. Every agent's save starts at once
(``AgentHandle.begin_save``: its state copied to host memory, a writer thread per agent), then
``state.pt``; :meth:`PendingCheckpoint.finish` waits for the writers, fsyncs every file and folder,
writes the manifest from the digests the writers computed as they wrote (no file is read back but
the few small ones libraries write by path), then the marker, and renames the folder into place
(and fsyncs the parent); older checkpoints are pruned only then. With ``checkpoint.async_save`` the
loop trains on between the two (trainer/run_checkpoints.py), so a checkpoint is visible to a resume
only once finished. A run killed mid-save leaves the previous checkpoint and a temp folder that the
next save removes; a save that fails (a full disk) removes its temp folder and says how much space
it needed.

Reading: :func:`resume_from` takes the newest checkpoint whose marker, manifest and file sizes check
out (:func:`verify_checkpoint` with ``hashes=False``: one ``stat`` per file) and loads it, every file
it loads hashed as it is read (``state.pt`` here, each agent's files by the agent) against the
manifest. A damaged newest checkpoint — a size or a hash that differs — is logged with the file it
names, moved aside to ``damaged-step-…`` (kept for inspection, never pruned) and the previous one
is tried; damage found otherwise while loading (another model size, other agents, a planted pickle in
``state.pt``) is handled the same way when an older checkpoint is left, and the run refuses to
resume — rather than restart at step 0 over the run's metrics and ``final/`` — when none is left that
loads. ``state.pt`` is read with ``torch.load(weights_only=True)``: it holds only tensors and plain
Python values, so a planted file cannot run code (older checkpoints stored numpy's RNG state as an
array: the few numpy types that needs are allow-listed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hacrl_megatron.agents.checkpoint_io import (
    DamagedCheckpointError,
    DigestMismatchError,
    FileDigest,
    HashingWriter,
    hash_file,
    prefixed,
)
from hacrl_megatron.durable import (
    OutOfSpaceError,
    free_bytes,
    fsync_dir,
    fsync_file,
    is_out_of_space,
    megabytes,
)
from hacrl_megatron.errors import InputError, Terminated, one_line_text
from hacrl_megatron.trainer.concurrency import for_each, runs_in_process
from hacrl_megatron.trainer.run_state import load_state_file, rng_state, set_rng_state

__all__ = ["MANIFEST", "MARKER", "PendingCheckpoint", "ResumeError", "begin_checkpoint", "find_resume_checkpoint",
           "latest_checkpoint", "load_checkpoint", "load_state_file", "read_manifest", "resume_from", "rng_state",
           "save_checkpoint", "set_rng_state", "verify_checkpoint", "write_manifest"]

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"
_HASH_THREADS = 8  # hashlib releases the GIL: files hashed after writing (or verified in full) in parallel


def _name(step: int) -> str:
    return f"step-{step:06d}"


# --------------------------------------------------------------------------------------------
# manifest


def _sha256(path: Path) -> str:
    return hash_file(path)["sha256"]


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MARKER, MANIFEST))


def _hash_all(folder: Path, rels: list[str]) -> list[str]:
    with ThreadPoolExecutor(min(_HASH_THREADS, max(1, len(rels)))) as pool:
        return list(pool.map(lambda rel: _sha256(folder / rel), rels))


def write_manifest(folder: Path, step: int, digests: dict[str, FileDigest] | None = None) -> None:
    """fsync every file and folder under ``folder``, then write the manifest and the marker durably.

    ``digests``: the writers' own size and SHA-256 of the files they wrote (relative paths), computed as
    the bytes went to disk; a file they do not list is hashed here (a second read of it). A listed
    file whose size on disk differs from what its writer wrote fails the save.
    """
    rels = [p.relative_to(folder).as_posix() for p in _files(folder)]
    for rel in rels:
        fsync_file(folder / rel)
    for sub in sorted({(folder / rel).parent for rel in rels}, key=lambda p: -len(p.parts)):
        fsync_dir(sub)
    known = digests or {}
    unlisted = [rel for rel in rels if rel not in known]
    gone = sorted(set(known) - set(rels))
    if gone:
        raise RuntimeError(f"{folder}: {', '.join(gone[:3])} written by the save but missing from the folder")
    read_back = dict(zip(unlisted, _hash_all(folder, unlisted)))
    files = {}
    for rel in rels:
        size = (folder / rel).stat().st_size
        if rel in known and known[rel]["size"] != size:
            raise RuntimeError(f"{folder / rel}: {size} bytes on disk, its writer wrote {known[rel]['size']}")
        files[rel] = {"size": size, "sha256": known[rel]["sha256"] if rel in known else read_back[rel]}
    text = json.dumps({"format": 1, "step": step, "files": files}, indent=1, sort_keys=True).encode()
    for name, data in ((MANIFEST, text), (MARKER, f"{step}\nmanifest-sha256 {hashlib.sha256(text).hexdigest()}\n".encode())):
        with open(folder / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(folder)


def read_manifest(path: str | os.PathLike) -> dict[str, FileDigest] | None:
    """The manifest's files of checkpoint ``path`` (relative path → size, SHA-256), checked against the
    marker's checksum; None for a checkpoint written before manifests existed (after a warning)."""
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
        return None
    try:
        text = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise DamagedCheckpointError(f"{path}: {MANIFEST} is missing") from None
    if hashlib.sha256(text).hexdigest() != expected:
        raise DamagedCheckpointError(f"{path}: {MANIFEST} does not match its checksum in {MARKER}")
    return json.loads(text)["files"]


def verify_checkpoint(path: str | os.PathLike, hashes: bool = True) -> bool:
    """Check ``path`` against its manifest; raise :class:`DamagedCheckpointError` saying what is wrong.

    Every listed file must exist with its size; ``hashes``: and hash to its SHA-256 (a full read of the
    checkpoint; a resume checks sizes only and hashes each file as it loads it). Returns False (after
    a warning) for a checkpoint written before manifests existed, True when verified.
    """
    path = Path(path)
    files = read_manifest(path)
    if files is None:
        return False
    for rel, want in files.items():
        f = path / rel
        if not f.is_file():
            raise DamagedCheckpointError(f"{path}: {rel} is missing")
        size = f.stat().st_size
        if size != want["size"]:
            raise DigestMismatchError(f"{path}: {rel} is {size} bytes, the manifest says {want['size']} (truncated?)")
    if hashes:
        for rel, digest in zip(files, _hash_all(path, list(files))):
            if digest != files[rel]["sha256"]:
                raise DigestMismatchError(f"{path}: {rel} does not match its SHA-256 in {MANIFEST} (corrupted)")
    return True


# --------------------------------------------------------------------------------------------
# save


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def _each_agent(runtimes, work: Callable[[Any], Any]) -> list[Any]:
    """``work(rt)`` for every runtime, all at once where an agent's ranks run elsewhere (trainer/concurrency.py)."""
    return for_each(list(runtimes), work, in_process=lambda rt: runs_in_process(rt.trainer))


def begin_checkpoint(root: str | os.PathLike, step: int, runtimes, state: dict[str, Any], keep: int = 2,
                     background: bool = False) -> PendingCheckpoint:
    """Start the checkpoint of every agent and the run ``state`` for ``step``: every agent's save begins
    at once and the call returns once each copied its state for its writer (and ``state.pt`` is
    written); :meth:`PendingCheckpoint.finish` completes it. ``background``: the agents train before
    ``finish`` (their writers then work on copies). A failure removes the temp folder (see
    :func:`save_checkpoint`)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{_name(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    begun: list[Any] = []

    def begin(rt: Any) -> None:
        rt.trainer.begin_save(str(tmp / "agents" / rt.name), background)
        begun.append(rt)

    try:
        for rt in runtimes:
            (tmp / "agents" / rt.name).mkdir(parents=True)  # the writers only create files, never folders
        _each_agent(runtimes, begin)
        with HashingWriter(tmp / "state.pt") as f:
            torch.save({**state, "step": step, "rng": rng_state()}, f)
    except BaseException as err:  # torch's distributed-checkpoint writer raises a BaseException subclass
        if not _interrupted(err):  # the agents whose writers started: wait for them before the removal
            _each_agent(begun, _end_quietly)
        _reraise(_discarded(tmp, root, step, err), err)
    return PendingCheckpoint(root, step, list(runtimes), keep, tmp, {"state.pt": f.digest})


def save_checkpoint(root: str | os.PathLike, step: int, runtimes, state: dict[str, Any], keep: int = 2) -> Path:
    """Write every agent and the run ``state`` for ``step`` atomically; keep the newest ``keep``.

    Raises :class:`OutOfSpaceError` ("no space left on <root>, needed ~N MB") when the disk fills;
    the partly written temp folder is removed either way.
    """
    return begin_checkpoint(root, step, runtimes, state, keep).finish()


class PendingCheckpoint:
    """A checkpoint whose agents may still be writing (:func:`begin_checkpoint`). It is complete — in
    its final folder, listed in its manifest, visible to a resume, older ones pruned — only once
    :meth:`finish` returns; until then a resume finds the previous checkpoint."""

    def __init__(self, root: Path, step: int, runtimes: list, keep: int, tmp: Path,
                 digests: dict[str, FileDigest]) -> None:
        self.root, self.step, self.runtimes, self.keep, self.tmp = root, step, runtimes, keep, tmp
        self._digests = digests

    def finish(self) -> Path:
        """Wait for every agent's writer, write the manifest from their digests and the marker, move
        the folder into place and prune; the checkpoint's folder."""
        final = self.root / _name(self.step)
        try:
            written = _end_every_save(self.runtimes)
            digests = dict(self._digests)
            for rt, files in zip(self.runtimes, written):
                digests.update(prefixed(f"agents/{rt.name}", files))
            write_manifest(self.tmp, self.step, digests)
        except BaseException as err:
            _reraise(_discarded(self.tmp, self.root, self.step, err), err)
        if final.exists():  # re-saving the same step (e.g. after a resume): replace the old one
            shutil.rmtree(final)
        os.replace(self.tmp, final)
        fsync_dir(self.root)
        _prune(self.root, self.keep)
        logger.debug("checkpoint written: %s", final)
        return final

    def abandon(self) -> None:
        """Discard the unfinished checkpoint (the run is stopping): its temp folder is removed until it
        stays gone. The writers' threads are daemons: they end with the process (or, if it goes on,
        after finishing their open files, which are no longer in any folder)."""
        _remove_until_it_stays_gone(self.tmp)


def _end_every_save(runtimes: list) -> list[dict[str, FileDigest]]:
    """Every agent's ``end_save`` even when one fails (no writer is left writing into the temp folder
    that the failure removes), then the first error; an interrupt stops at once."""
    def end(rt: Any) -> tuple[Any, BaseException | None]:
        try:
            return rt.trainer.end_save(), None
        except BaseException as err:  # noqa: BLE001 - raised below once every agent's writer ended
            if _interrupted(err):
                raise
            return None, err

    outcomes = _each_agent(runtimes, end)
    failed = [err for _, err in outcomes if err is not None]
    if failed:
        raise failed[0]
    return [files for files, _ in outcomes]


def _reraise(replacement: BaseException, err: BaseException) -> None:
    if replacement is err:
        raise err
    raise replacement from err


def _interrupted(err: BaseException) -> bool:
    return isinstance(err, (KeyboardInterrupt, SystemExit, Terminated))  # Ctrl-C, SIGTERM, exit


def _end_quietly(rt: Any) -> None:
    """Wait for an agent's writer of a save that failed elsewhere (its own error does not matter then)."""
    try:
        rt.trainer.end_save()
    except BaseException as err:  # noqa: BLE001 - the save's first error is the one raised (torch's is a BaseException)
        if _interrupted(err):
            raise
        logger.debug("%s: ending a failed save", rt.name, exc_info=True)


def _discarded(tmp: Path, root: Path, step: int, err: BaseException) -> BaseException:
    """Remove a failed save's temp folder; the error to raise (a full disk becomes :class:`OutOfSpaceError`)."""
    interrupted = _interrupted(err)
    written, full = _tree_bytes(tmp), not interrupted and is_out_of_space(err, root)
    if interrupted:
        _remove_until_it_stays_gone(tmp)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return _out_of_space(root, step, written) if full else err


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


def find_resume_checkpoint(root: str | os.PathLike, hashes: bool = True) -> Path | None:
    """The newest checkpoint under ``root`` that verifies against its manifest (None when none does);
    ``hashes``: every file hashed too, else sizes only (:func:`verify_checkpoint`).

    A newer one that fails is logged with the reason and renamed to ``damaged-step-…`` so that
    neither a later resume nor the pruning of old checkpoints counts it.
    """
    root = Path(root)
    while (path := latest_checkpoint(root)) is not None:
        try:
            verify_checkpoint(path, hashes=hashes)
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

    The manifest and every file's size are checked first; ``load`` restores the run from a checkpoint
    (:func:`load_checkpoint`), hashing each file it reads, so a file whose bytes differ from the
    manifest is caught there, before it is parsed. Other damage it finds (another model size, other
    agents, a planted pickle) is handled like damage the manifest finds: the
    checkpoint is logged, moved aside to ``damaged-step-…`` and the previous one is tried. Returns
    None when ``root`` holds no checkpoint at all. Raises :class:`ResumeError` when the only checkpoint
    left cannot be loaded (it stays in place), or when every checkpoint was damaged.
    """
    root = Path(root)
    while (path := find_resume_checkpoint(root, hashes=False)) is not None:  # sizes: load hashes what it reads
        try:
            return path, load(path)
        except DigestMismatchError as err:  # a file that differs from the manifest: like damage verify finds
            logger.warning("skipping damaged checkpoint: %s; moved to %s, trying the previous one", err,
                           _move_aside(path).name)
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
    """Restore every agent from ``path`` and return the run state (RNG states already applied).

    Each file is hashed as it is read against the manifest (``state.pt`` here, each agent's own files
    by the agent: ``AgentHandle.load(path, expected)``); a differing one raises
    :class:`DigestMismatchError` naming it."""
    path = Path(path)
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {MARKER} marker)")
    files = read_manifest(path) or {}
    agents_dir = path / "agents"
    saved = sorted(p.name for p in agents_dir.iterdir()) if agents_dir.is_dir() else []
    names = sorted(rt.name for rt in runtimes)
    if saved != names:
        raise ValueError(f"{path}: checkpoint holds agents {saved}, this run has {names}")
    state = load_state_file(path / "state.pt", files.get("state.pt"))  # first: a bad file fails before any agent changes
    named = path.name[len("step-"):]
    folder_step = int(named) if path.name.startswith("step-") and named.isdigit() else None
    if not isinstance(state, dict):
        raise DamagedCheckpointError(f"{path}: state.pt holds a {type(state).__name__}, not a run state")
    if folder_step is not None and state.get("step") != folder_step:
        raise DamagedCheckpointError(f"{path}: state.pt holds step {state.get('step')!r}, not the folder's step "
                                     f"{folder_step} (a run state from elsewhere)")
    for rt in runtimes:
        inside = f"agents/{rt.name}/"
        expected = {rel[len(inside):]: d for rel, d in files.items() if rel.startswith(inside)}
        rt.trainer.load(str(agents_dir / rt.name), expected or None)
    set_rng_state(state["rng"])
    return state
