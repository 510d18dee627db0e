"""One run per output folder: an exclusive lock for the run's lifetime and the run's identity.

**Lock.** ``<folder>/.hacrl.lock`` is locked with ``fcntl.flock`` while the run lives. The kernel
drops the lock when the holder dies (kill -9 included), so a dead run never blocks a later one;
the pid and host written into the file only name the holder in the refusal message, and a file
still naming a process when its lock is free is reported as stale and taken over. On a
filesystem without ``flock`` the pid/host are checked instead (a dead pid on this host is stale).

**Identity.** ``<output_dir>/run.json`` holds the run's resolved configuration. A new run into a
folder that already holds a run (``metrics.jsonl``, checkpoints, ``final/``, ``tensorboard/``)
refuses unless ``checkpoint.resume=true`` and every field that shapes the weights or the data
agrees with the saved one; fields matching :data:`MAY_CHANGE_ON_RESUME` (run length, logging,
evaluation, checkpointing, process layout and throughput knobs) may differ. Refusals raise
:class:`RunFolderError` (the CLI exits with status 2).
"""

from __future__ import annotations

import datetime
import errno
import fnmatch
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hacrl_megatron.durable import write_durably

logger = logging.getLogger(__name__)

LOCK_FILE = ".hacrl.lock"
RUN_FILE = "run.json"
# what a run that got to its first step leaves in output_dir (a run.json alone holds nothing to lose)
RUN_CONTENT = ("metrics.jsonl", "final", "tensorboard")
# configuration fields a resume may change: nothing here shapes the weights or the data
MAY_CHANGE_ON_RESUME = (
    "name", "output_dir", "train.steps", "train.eval_every", "train.cpu_threads", "train.micro_batch_size",
    "train.verifier_workers", "data.eval_size", "data.eval_benchmarks", "checkpoint.*", "log.*",
    "agents.*.workers", "agents.*.parallel.tp", "agents.*.parallel.pp", "agents.*.parallel.dp",
    "agents.*.parallel.sequence_parallel", "agents.*.rollout_gpu_ids", "rollout.sglang_*", "rollout.weight_sync",
    "rollout.weight_sync_bucket_mb", "rollout.colocate",
)


class RunFolderError(RuntimeError):
    """A run may not use this folder (held by another run, or holding another run); names the folder."""


# --------------------------------------------------------------------------------------------
# the lock


@dataclass
class FolderLock:
    """An exclusive lock on one folder, held until :meth:`release` (or the process's death)."""

    folder: Path
    fd: int = -1
    uses_flock: bool = True

    @classmethod
    def acquire(cls, folder: Path) -> FolderLock:
        import fcntl

        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        lock = cls(folder, fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunFolderError(f"{folder} is in use by another run ({holder}); wait for it to finish, "
                                 "stop it, or choose another output_dir") from None
        except OSError as err:  # no flock on this filesystem (some network filesystems)
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            lock.uses_flock = False
            lock._check_pid_file()
        previous = _read_holder(fd)
        if previous and lock.uses_flock:
            logger.warning("%s: stale lock of a run that ended without releasing it (%s): taking it over",
                           path, previous)
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} host {socket.gethostname()} since {stamp}\n".encode(), 0)
        return lock

    def _check_pid_file(self) -> None:
        """Without flock: refuse when the recorded holder is alive (or on another host, unknowable)."""
        text = _read_holder(self.fd)
        parts = text.split()
        if len(parts) < 4:
            return
        pid, host = int(parts[1]), parts[3]
        if host == socket.gethostname():
            if pid == os.getpid() or not _alive(pid):
                logger.warning("%s: stale lock of a dead process (%s): taking it over", self.folder / LOCK_FILE, text)
                return
        os.close(self.fd)
        where = "" if host == socket.gethostname() else f"; if that run is gone, delete {self.folder / LOCK_FILE}"
        raise RunFolderError(f"{self.folder} is in use by another run ({text}){where}")

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)  # an empty file: nothing stale is reported next time
        finally:
            os.close(self.fd)  # closing drops the flock
            self.fd = -1


def _read_holder(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace").strip()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------------------------
# run identity and the config check


def checkpoint_dir(exp: Any) -> Path:
    """Where ``exp``'s checkpoints live (``checkpoint.dir``, default ``<output_dir>/checkpoints``)."""
    return Path(exp.checkpoint.dir or Path(exp.output_dir) / "checkpoints")


def resume_note(exp: Any) -> str:
    """Where an interrupted run can continue from: its newest complete checkpoint, or none yet."""
    root = checkpoint_dir(exp)
    done = sorted(p for p in root.glob("step-*") if (p / "COMPLETE").exists()) if root.is_dir() else []
    if not done:
        return f"no checkpoint written yet in {root}"
    return f"last checkpoint: {done[-1]} (continue with checkpoint.resume=true)"


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train": {"seed": 0}, "agents": [{...}]}`` → ``{"train.seed": 0, "agents.0.name": ...}``."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, sub in items:
        out.update(flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Fields that shape the weights or the data and differ: ``"train.seed: 0 (saved) vs 1 (now)"``.

    A field missing from either side (added or removed by another version) is not compared.
    """
    old, new = flatten(saved), flatten(current)
    diffs = []
    n_old, n_new = len(saved.get("agents", [])), len(current.get("agents", []))
    if n_old != n_new:
        diffs.append(f"agents: {n_old} agents (saved) vs {n_new} (now)")
    for key in sorted(set(old) & set(new)):
        pattern_key = ".".join("*" if part.isdigit() else part for part in key.split("."))
        if any(fnmatch.fnmatchcase(pattern_key, p) for p in MAY_CHANGE_ON_RESUME):
            continue
        if old[key] != new[key]:
            diffs.append(f"{key}: {old[key]!r} (saved) vs {new[key]!r} (now)")
    return diffs


def _held_content(exp: Any) -> list[str]:
    """What a previous run left: its files in the output folder and its checkpoints."""
    out, ckpt = Path(exp.output_dir), checkpoint_dir(exp)
    found = [name for name in RUN_CONTENT if (out / name).exists()]
    steps = sorted(ckpt.glob("step-*")) if ckpt.is_dir() else []
    if steps:
        found.append(f"{len(steps)} checkpoint(s) in {ckpt}")
    return found


def _run_folders(exp: Any) -> list[Path]:
    """The output folder, and the checkpoint folder when it lies outside (both get a lock and run.json)."""
    out, ckpt = Path(exp.output_dir).resolve(), checkpoint_dir(exp).resolve()
    return [out] if ckpt.is_relative_to(out) else [out, ckpt]


def check_run_folder(exp: Any) -> None:
    """Raise :class:`RunFolderError` unless ``exp`` may start or continue in its output folder."""
    out, held = Path(exp.output_dir), _held_content(exp)
    if not held:
        return
    if not exp.checkpoint.resume:
        raise RunFolderError(
            f"{out} already holds a run ({', '.join(held)}); continue it with checkpoint.resume=true "
            "(same configuration), or choose another output_dir")
    run_files = [f / RUN_FILE for f in _run_folders(exp) if (f / RUN_FILE).exists()]
    if not run_files:
        logger.warning("%s: no %s (written by an older version): the configuration cannot be compared", out, RUN_FILE)
    for run_file in run_files:
        try:
            saved = json.loads(run_file.read_text())["config"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise RunFolderError(f"{run_file}: unreadable run record ({err}); cannot check that the resume "
                                 "continues the same run") from err
        diffs = config_differences(saved, exp.to_dict())
        if diffs:
            raise RunFolderError(
                f"cannot resume the run in {run_file.parent}: these fields differ from its {RUN_FILE} and shape "
                f"the weights or the data: {'; '.join(diffs)} (a resume may change run length, logging, "
                "evaluation, checkpointing and layout only)")


def record_run(exp: Any) -> None:
    """Write (or, on a resume, update) ``run.json`` in the run's folders with ``exp``'s configuration."""
    start = {"time": datetime.datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
             "pid": os.getpid(), "resume": bool(exp.checkpoint.resume)}
    for folder in _run_folders(exp):
        path = folder / RUN_FILE
        record: dict[str, Any] = {"config": exp.to_dict(), "starts": []}
        if path.exists():
            try:
                record["starts"] = list(json.loads(path.read_text()).get("starts", []))
            except (OSError, ValueError, AttributeError, TypeError):
                pass
        record["starts"].append(start)
        write_durably(path, json.dumps(record, indent=1, default=str) + "\n")


@dataclass
class RunFolder:
    """The claimed folders of one run (output folder, and the checkpoint folder when outside it)."""

    locks: list[FolderLock] = field(default_factory=list)

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def claim_run_folder(exp: Any) -> RunFolder:
    """Lock ``exp``'s folders, check it may use them, record the run; call before any work.

    Raises :class:`RunFolderError` (nothing locked) when another run holds a folder or the folder
    holds a run this one may not continue.
    """
    claimed = RunFolder()
    try:
        for folder in _run_folders(exp):
            claimed.locks.append(FolderLock.acquire(folder))
        check_run_folder(exp)
        record_run(exp)
    except BaseException:
        claimed.release()
        raise
    return claimed

