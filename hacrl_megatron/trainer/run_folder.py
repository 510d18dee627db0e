"""One run per output folder: an exclusive lock for the run's lifetime and the run's identity.

**Lock.** ``<folder>/.hacrl.lock`` is locked with ``fcntl.flock`` while the run lives. The kernel
drops the lock when the holder dies (kill -9 included), so a dead run never blocks a later one;
the pid and host written into the file only name the holder in the refusal message, and a file
still naming a process when its lock is free is reported as stale and taken over. On a
filesystem without ``flock`` the pid/host are checked instead (a dead pid on this host is stale).

**Identity.** ``run.json`` in each folder a run writes (``output_dir``, and ``checkpoint.dir`` when
it lies outside) holds the run's id, the folder's role (``output`` or ``checkpoints``) and the
resolved configuration. Every such folder is claimed by the same rules:

- a new run refuses a folder that holds a run (``metrics.jsonl``, ``final/``, ``tensorboard/``,
  checkpoints in it or in its ``checkpoints/``) and any folder inside another run's folder;
- ``checkpoint.resume=true`` continues only the same run, in the same role (another run's output
  folder is never taken as a checkpoint folder), and only when every field that shapes the weights
  or the data agrees; fields matching :data:`MAY_CHANGE_ON_RESUME` (run length, logging,
  evaluation, checkpointing, process layout and throughput knobs) may differ;
- a ``run.json`` is rewritten only by its own run, or where its run left nothing to lose.

Refusals raise :class:`RunFolderError` (the CLI exits with status 2). Before any of this, every path
the run writes is checked (:func:`check_output_paths`).
"""

from __future__ import annotations

import datetime
import errno
import fnmatch
import json
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hacrl_megatron.durable import write_durably
from hacrl_megatron.outputs import (
    CHECKPOINT_ROLE,
    OUTPUT_ROLE,
    RUN_CONTENT,
    RUN_FILE,
    OutputPathError,
    check_dir,
    check_file,
    read_run_record,
    record_role,
    run_owner,
)
from hacrl_megatron.paths import CACHE_ENV, default_cache_dir

logger = logging.getLogger(__name__)

LOCK_FILE = ".hacrl.lock"
# configuration fields a resume may change: nothing here shapes the weights or the data
MAY_CHANGE_ON_RESUME = (
    "name", "output_dir", "train.steps", "train.eval_every", "train.cpu_threads", "train.micro_batch_size",
    "train.max_tokens_per_microbatch", "train.pack_sequences",  # how a mini-batch is cut up, not what it holds
    "train.verifier_workers", "data.eval_size", "data.eval_benchmarks", "checkpoint.*", "log.*",
    "train.eval_samples", "train.eval_temperature", "data.benchmark_paths", "data.eval_limit",
    "agents.*.workers", "agents.*.parallel.tp", "agents.*.parallel.pp", "agents.*.parallel.dp",
    "agents.*.parallel.sequence_parallel", "agents.*.parallel.cp", "agents.*.parallel.overlap_grad_reduce",
    "agents.*.parallel.overlap_param_gather", "agents.*.parallel.ddp_bucket_mb", "agents.*.rollout_gpu_ids", "rollout.sglang_*", "rollout.weight_sync",
    "rollout.sglang.*", "rollout.hf.*", "rollout.vllm.*",  # where and how the engines run, not what they sample
    "rollout.weight_sync_bucket_mb", "rollout.colocate",
    "rollout.colocate_offload",  # where the trainer's state waits while the engines generate: restored bit for bit
    "exchange.*",  # where the records travel and how long a step waits for them, not what they hold
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


def _run_folders(exp: Any) -> list[tuple[Path, str]]:
    """(folder, role): the output folder, and the checkpoint folder when it lies outside it."""
    out, ckpt = Path(exp.output_dir).resolve(), checkpoint_dir(exp).resolve()
    return [(out, OUTPUT_ROLE)] if ckpt.is_relative_to(out) else [(out, OUTPUT_ROLE), (ckpt, CHECKPOINT_ROLE)]


def _held_content(folder: Path, extra: Path | None = None) -> list[str]:
    """What a run left in ``folder``: metrics, exports, checkpoints (in it, its ``checkpoints/``, ``extra``)."""
    found = [name for name in RUN_CONTENT if (folder / name).exists()]
    for where in dict.fromkeys(p for p in (folder, folder / "checkpoints", extra) if p is not None):
        steps = sorted(where.glob("step-*")) if where.is_dir() else []
        if steps:
            found.append(f"{len(steps)} checkpoint(s) in {where}")
    return found


def check_output_paths(exp: Any) -> None:
    """Every path the run writes is usable (:mod:`hacrl_megatron.outputs`): the output and checkpoint
    folders, ``metrics.jsonl``, ``final/``, ``tensorboard/``, ``samples/`` and, when the run uses it, ``$HACRL_CACHE``.
    Raises :class:`~hacrl_megatron.outputs.OutputPathError` (exit 2) naming the path."""
    probed: set[Path] = set()  # each existing folder is written to once
    out = check_dir(exp.output_dir, "output_dir", probed)
    check_dir(checkpoint_dir(exp), "checkpoint.dir" if exp.checkpoint.dir else "output_dir (its checkpoints/)", probed)
    if exp.log.jsonl:
        check_file(out / "metrics.jsonl", "output_dir's metrics file", probed)
    for name, used in (("final", True), ("tensorboard", exp.log.tensorboard), ("samples", exp.log.samples_every > 0)):
        if used:
            check_dir(out / name, f"output_dir's {name}/", probed)
    if uses_cache(exp):
        check_dir(default_cache_dir(), f"the cache (${CACHE_ENV})", probed)


def uses_cache(exp: Any) -> bool:
    """Whether the run writes into the cache: built-in tokenizers, SmolLM2's conversion, warm-ups."""
    from hacrl_megatron.exchange.tokenizers import BUILTIN_TOKENIZERS

    return any(a.tokenizer in BUILTIN_TOKENIZERS or a.model.hf_path == "smollm2" for a in exp.agents) or (
        exp.train.sft_warmup and any(a.init_checkpoint is None and a.model.hf_path is None for a in exp.agents))


def _check_not_inside_another_run(folders: list[tuple[Path, str]]) -> None:
    claimed = {f for f, _ in folders}
    for folder, _ in folders:
        owner = run_owner(folder.parent)
        if owner is not None and owner[0] not in claimed:
            raise RunFolderError(f"{folder} lies inside {owner[0]}, a folder of another run ({owner[0] / RUN_FILE}): "
                                 "a run writes only into folders of its own; choose one outside it")


ABANDONED_PREFIX = "abandoned-"  # <folder>/abandoned-<UTC time>/: what a run that never checkpointed left


def _set_aside(folder: Path, found: list[str]) -> None:
    """Move what a run that stopped before its first checkpoint left in ``folder`` (metrics, TensorBoard
    events, samples, its run record) into ``folder/abandoned-<UTC time>/``, with a notice: a new run may
    take the folder over, and nothing is deleted."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    aside = folder / f"{ABANDONED_PREFIX}{stamp}"
    aside.mkdir()
    moved = [name for name in (*RUN_CONTENT, "samples", RUN_FILE) if (folder / name).exists()]
    for name in moved:
        os.replace(folder / name, aside / name)
    logger.warning("%s held a run that stopped before its first checkpoint (%s): nothing to resume, so this run "
                   "takes the folder over; what it left is kept in %s", folder, ", ".join(found), aside)


def check_run_folder(exp: Any) -> str:
    """Raise :class:`RunFolderError` unless ``exp`` may start or continue in its folders; returns the
    run's id (a new one, or on a resume the id of the run it continues)."""
    folders = _run_folders(exp)
    ckpt = checkpoint_dir(exp).resolve()
    held = {f: _held_content(f, ckpt if ckpt.is_relative_to(f) else None) for f, _ in folders}
    if not exp.checkpoint.resume:
        for folder, found in held.items():
            if found and not any("checkpoint" in item or item == "final" for item in found):
                _set_aside(folder, found)  # its run stopped before its first checkpoint: nothing to continue
            elif found:
                raise RunFolderError(
                    f"{folder} already holds a run ({', '.join(found)}); continue it with checkpoint.resume=true "
                    "(same configuration), or choose another output_dir" + ("" if folder == folders[0][0] else
                                                                            " and checkpoint.dir"))
        return uuid.uuid4().hex
    records = {f: read_run_record(f) for f, _ in folders}
    ids = [r["run_id"] for r in records.values() if r and r.get("run_id")]
    run_id = ids[0] if ids else uuid.uuid4().hex
    if not any(records.values()) and any(held.values()):
        logger.warning("%s: no %s (written by an older version): the configuration cannot be compared",
                       folders[0][0], RUN_FILE)
    for folder, role in folders:
        if records[folder] is not None:
            _check_same_run(folder, role, records[folder], run_id, exp, bool(held[folder]))
    return run_id


def _check_same_run(folder: Path, role: str, saved: dict, run_id: str, exp: Any, holds: bool) -> None:
    """A resume continues the run recorded in ``folder`` only as that run, in the same role (a folder
    holding nothing of its recorded run has nothing to continue: its record is replaced)."""
    if not holds:
        return
    saved_role = record_role(folder, saved)
    if saved_role != role:
        raise RunFolderError(f"cannot resume in {folder}: it is the {saved_role} folder of a run ({folder / RUN_FILE}), "
                             f"and this run would use it as its {role} folder; choose another "
                             + ("output_dir" if role == OUTPUT_ROLE else "checkpoint.dir"))
    if saved.get("run_id") not in (None, run_id):
        raise RunFolderError(f"cannot resume in {folder}: it holds another run ({folder / RUN_FILE}, run_id "
                             f"{saved['run_id']}) than the one this resume continues ({run_id})")
    try:
        diffs = config_differences(saved["config"], exp.to_dict())
    except (KeyError, TypeError, AttributeError) as err:
        raise RunFolderError(f"{folder / RUN_FILE}: unreadable run record ({err!r}); cannot check that the resume "
                             "continues the same run") from err
    if diffs:
        raise RunFolderError(
            f"cannot resume the run in {folder}: these fields differ from its {RUN_FILE} and shape "
            f"the weights or the data: {'; '.join(diffs)} (a resume may change run length, logging, "
            "evaluation, checkpointing and layout only)")


def record_run(exp: Any, run_id: str) -> None:
    """Write (or, on a resume, update) ``run.json`` in the run's folders: its id, the folder's role,
    ``exp``'s configuration and the list of starts. A record of another run is replaced only where
    :func:`check_run_folder` found nothing of it to lose."""
    start = {"time": datetime.datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
             "pid": os.getpid(), "resume": bool(exp.checkpoint.resume)}
    for folder, role in _run_folders(exp):
        record: dict[str, Any] = {"run_id": run_id, "role": role, "config": exp.to_dict(), "starts": []}
        try:
            saved = read_run_record(folder)
        except OutputPathError:
            saved = None
        if saved is not None and saved.get("run_id") in (None, run_id):
            starts = saved.get("starts", [])
            record["starts"] = list(starts) if isinstance(starts, list) else []
        record["starts"].append(start)
        write_durably(folder / RUN_FILE, json.dumps(record, indent=1, default=str) + "\n")


@dataclass
class RunFolder:
    """The claimed folders of one run (output folder, and the checkpoint folder when outside it)."""

    locks: list[FolderLock] = field(default_factory=list)
    run_id: str = ""

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def claim_run_folder(exp: Any) -> RunFolder:
    """Check every output path, lock ``exp``'s folders, check it may use them, record the run; call
    before any work.

    Raises :class:`~hacrl_megatron.outputs.OutputPathError` for a path that cannot be written and
    :class:`RunFolderError` (nothing locked) when another run holds a folder, the folder holds a run
    this one may not continue, or a folder lies inside another run's folder.
    """
    check_output_paths(exp)
    _check_not_inside_another_run(_run_folders(exp))  # before the locks create any folder
    claimed = RunFolder()
    try:
        for folder, _ in _run_folders(exp):
            claimed.locks.append(FolderLock.acquire(folder))
        claimed.run_id = check_run_folder(exp)
        record_run(exp, claimed.run_id)
    except BaseException:
        claimed.release()
        raise
    return claimed
