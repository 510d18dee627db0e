"""The one place that checks and claims the paths a run or a command writes, before any work.

Every ``hacrl`` command that writes (``train``, ``pretrain``, ``eval --out``, ``convert --to-*``,
``prepare``) checks its output paths here first, so a path that cannot be used stops the command
with one line naming the path and what is wrong with it (exit status 2) instead of a traceback
after the models are built:

- a component of the path is a file (``output_dir=notes.txt/run``);
- the folder (or the nearest existing one above it, where it will be created) cannot be written:
  a read-only filesystem, no permission, a full filesystem (probed by writing one byte);
- a file the command will append to is a folder (``metrics.jsonl`` made a directory);
- the path is a place a run writes itself: a run's output folder, its ``checkpoints/``,
  ``final/`` or ``tensorboard/``, or anything inside a run's own checkpoint folder. Only that run
  writes there (:mod:`hacrl_megatron.trainer.run_folder` claims them with a lock and ``run.json``).
  Folders of its own inside a run's output folder (``runs/demo/eval``) are fine.

``hacrl plan`` writes no files (it prints), so it has nothing to claim.

A leaf module (standard library and :mod:`hacrl_megatron.errors` only).
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

from hacrl_megatron.errors import InputError

RUN_FILE = "run.json"  # a run's identity; the folder holding it belongs to that run
# what a run that got to its first step leaves in its output folder
RUN_CONTENT = ("metrics.jsonl", "final", "tensorboard")
OUTPUT_ROLE, CHECKPOINT_ROLE = "output", "checkpoints"
_RESERVED = ("checkpoints", *RUN_CONTENT)  # inside a run's output folder, written by that run only
_NAME_MAX = 255  # bytes per path component on Linux filesystems
_PATH_MAX = 4095


class OutputPathError(InputError):
    """An output path that cannot be used; the message names the path and what is wrong with it."""


def path_problem(path: str) -> str | None:
    """Why ``path`` can never name a file here (pure: no file access), or None.

    Empty, a component longer than 255 bytes (the filesystem refuses the name), the whole path
    longer than 4095 bytes, or a NUL byte.
    """
    if path == "":
        return "is empty"
    if "\0" in path:
        return "contains a NUL byte"
    if len(os.fsencode(path)) > _PATH_MAX:
        return f"is longer than {_PATH_MAX} bytes"
    for part in Path(path).parts:
        if len(os.fsencode(part)) > _NAME_MAX:
            return f"has a component of {len(os.fsencode(part))} bytes ({part[:20]}...): at most {_NAME_MAX}"
    return None


def _first_existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor; raises when a component on the way is a file."""
    for parent in [path, *path.parents]:
        if parent.is_dir():
            return parent
        if parent.exists() or parent.is_symlink():
            if parent.is_symlink() and not parent.exists():
                raise OutputPathError(f"{path}: {parent} is a broken symbolic link")
            raise OutputPathError(f"{path}: {parent} is a file, not a folder")
    return Path(path.anchor or ".")


def _probe_write(folder: Path, path: Path, what: str) -> None:
    """Create, write one byte to and remove a file in ``folder``: the only test that sees a read-only
    mount, a missing permission (also for root on some filesystems) and a full disk alike (local
    filesystems refuse the byte at once; a network filesystem at the latest when the file closes)."""
    fd, name = -1, ""
    try:
        fd, name = tempfile.mkstemp(prefix=".hacrl-probe-", dir=folder)
        os.write(fd, b"\0")
        fd, written = -1, fd
        os.close(written)
    except OSError as err:
        why = {errno.EROFS: f"{folder} is on a read-only filesystem",
               errno.EACCES: f"{folder} is not writable (permission denied)",
               errno.EPERM: f"{folder} is not writable (operation not permitted)",
               errno.ENOSPC: f"no space left on the filesystem of {folder}",
               errno.EDQUOT: f"disk quota exceeded on the filesystem of {folder}"}.get(
                   err.errno, f"{folder} cannot be written ({err.strerror or err})")
        raise OutputPathError(f"{what} {path}: {why}") from None
    finally:
        if fd >= 0:
            os.close(fd)
        if name:
            try:
                os.unlink(name)
            except OSError:
                pass


def check_dir(path: str | os.PathLike, what: str, probed: set[Path] | None = None) -> Path:
    """``path`` as a folder the caller will create (if missing) and write into; returns it absolute.

    Raises :class:`OutputPathError` naming ``what`` (the field or flag, e.g. ``output_dir``) and
    the path when it cannot be. ``probed``: folders already found writable by the caller's other
    checks (each is written to once), updated.
    """
    text = os.fspath(path)
    problem = path_problem(text)
    if problem:
        raise OutputPathError(f"{what} {text!r} {problem}")
    target = Path(text).expanduser().absolute()
    try:
        existing = _first_existing(target)
    except OutputPathError as err:
        raise OutputPathError(f"{what} {err}") from None
    if probed is None or existing not in probed:
        _probe_write(existing, target, what)
        if probed is not None:
            probed.add(existing)
    return target


def check_file(path: str | os.PathLike, what: str, probed: set[Path] | None = None) -> Path:
    """``path`` as a file the caller will create or append to (its folder checked like :func:`check_dir`)."""
    target = Path(os.fspath(path)).expanduser().absolute()
    if target.is_dir():
        raise OutputPathError(f"{what} {target}: is a folder, not a file")
    if target.exists() and not os.access(target, os.W_OK):
        raise OutputPathError(f"{what} {target}: is not writable")
    check_dir(target.parent, what, probed)
    return target


def read_run_record(folder: Path) -> dict | None:
    """``folder/run.json`` as a dict, None when there is none; raises when it is unreadable."""
    path = folder / RUN_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise OutputPathError(f"{path}: unreadable run record ({err}); it marks {folder} as a run's folder") from None
    if not isinstance(record, dict):
        raise OutputPathError(f"{path}: unreadable run record (not a JSON object)")
    return record


def record_role(folder: Path, record: dict) -> str:
    """The role of a run folder: ``output`` or ``checkpoints`` (inferred for records without one:
    an output folder holds metrics, exports or a ``checkpoints/`` folder)."""
    role = record.get("role")
    if role in (OUTPUT_ROLE, CHECKPOINT_ROLE):
        return role
    holds_output = any((folder / name).exists() for name in (*RUN_CONTENT, "checkpoints"))
    return OUTPUT_ROLE if holds_output else CHECKPOINT_ROLE


def run_owner(path: Path) -> tuple[Path, str, dict] | None:
    """(folder, role, record) of the nearest folder at or above ``path`` holding a ``run.json``."""
    for folder in [path, *path.parents]:
        record = read_run_record(folder) if folder.is_dir() else None
        if record is not None:
            return folder, record_role(folder, record), record
    return None


def reserved_by_run(path: Path) -> str | None:
    """Why ``path`` is a place only a run writes (see the module docstring), or None."""
    owner = run_owner(path)
    if owner is None:
        return None
    folder, role, _ = owner
    if role == CHECKPOINT_ROLE:
        return f"lies in {folder}, the checkpoint folder of a run ({folder / RUN_FILE})"
    if path == folder:
        return f"is the output folder of a run ({folder / RUN_FILE})"
    first = path.relative_to(folder).parts[0]
    if first in _RESERVED:
        return f"is written by the run in {folder} ({first}/; {folder / RUN_FILE})"
    return None


def claim_output(path: str | os.PathLike, what: str, kind: str = "dir") -> Path:
    """Check a command's output ``path`` (``kind`` ``dir`` or ``file``): usable and not a run's own place.

    Returns the absolute path; raises :class:`OutputPathError` naming ``what`` and the path.
    """
    target = check_dir(path, what) if kind == "dir" else check_file(path, what)
    why = reserved_by_run(target if kind == "dir" else target.parent)
    if why:
        raise OutputPathError(f"{what} {target}: {why}; write into a folder of its own (e.g. <run>/eval)")
    return target
