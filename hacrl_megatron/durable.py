"""Durable file writes: fsync of files and folders, atomic text writes, and a disk-full error that
says where and how much space was needed.

A leaf module (standard library only): checkpoints, metrics, run records and ``hacrl prepare``
write through it without importing one another.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NEARLY_FULL = 1 << 20  # bytes: a write that failed with less than this free is taken to be a full disk


class OutOfSpaceError(OSError):
    """A write failed because the filesystem is full; the message names the path and the space needed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC

    def __str__(self) -> str:
        return self.args[0]


def fsync_file(path: str | os.PathLike) -> None:
    """Flush ``path``'s data to stable storage (also for files another process wrote)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory ``path`` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as err:  # some filesystems cannot fsync a directory; the data itself was synced
        if err.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a synced temporary file and an atomic rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged process may still write on ``path``'s filesystem."""
    return shutil.disk_usage(path).free


def is_out_of_space(err: BaseException, path: str | os.PathLike) -> bool:
    """Whether ``err`` (or anything in its cause chain) is a full disk or quota at ``path``.

    Some writers hide the errno (torch's zip writer says ``unexpected pos 704 vs 598``; megatron's
    writer processes re-raise as ``Worker failure``), so a failed write with less than 1 MiB left on
    ``path`` also counts.
    """
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if getattr(e, "errno", None) in _OUT_OF_SPACE or "No space left" in str(e) or "Disk quota" in str(e):
            return True
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch distributed checkpoint: {rank: (error, traceback)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    try:
        return free_bytes(path) < _NEARLY_FULL
    except OSError:
        return False


def megabytes(n: int) -> str:
    """``n`` bytes as decimal megabytes for messages: one decimal from 0.1 MB on, else two digits."""
    return f"{n / 1e6:.1f}" if n >= 1e5 else f"{n / 1e6:.2g}"
