"""``shared_dir`` backend: one JSON file per (step, agent) in a folder every job can reach.

Layout: ``<dir>/<run_id>/step-<step:08d>.<agent>.json``, human-readable (one field per line). A
record is written to a hidden temporary file in the same folder, flushed and fsynced, then renamed
over its final name: POSIX rename is atomic, so a reader sees the old file, the new file or none,
never a part of one, and two writers of the same name leave one of their records whole. Any POSIX
filesystem the jobs share works (NFS, Lustre, GPFS: rename within one folder is atomic there too).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from pathlib import Path

from hacrl_megatron.durable import OutOfSpaceError, fsync_dir
from hacrl_megatron.errors import InputError
from hacrl_megatron.exchange.remote.record import DEFAULT_LIMITS, Limits, refusal
from hacrl_megatron.exchange.remote.store import (
    MAX_HOLDER_CHARS,
    MAX_RUN_DOC_BYTES,
    ExchangeBackendError,
    ExchangeStore,
)

_NAME_RE = re.compile(r"step-(\d{8})\.([A-Za-z_][A-Za-z0-9_]*)\.json")
_TMP_PREFIX = ".tmp-"


class SharedDirStore(ExchangeStore):
    """Records of run ``run_id`` under ``root``/``run_id``/ (created if absent)."""

    backend = "shared_dir"

    def __init__(self, root: str | os.PathLike, run_id: str, *, key: bytes | None = None,
                 limits: Limits = DEFAULT_LIMITS) -> None:
        super().__init__(run_id, key=key, limits=limits)
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise InputError(f"exchange.dir {root}: exists and is not a folder")
        self.folder = root / self.run_id
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise InputError(f"exchange.dir {root}: cannot create {self.folder} ({err.strerror})") from None

    def path(self, step: int, agent: str) -> Path:
        return self.folder / f"step-{step:08d}.{agent}.json"

    def claim_path(self, agent: str) -> Path:
        return self.folder / f"claim.{agent}"

    def _put(self, step: int, agent: str, data: bytes) -> None:
        self._write(self.path(step, agent), data)

    def _put_claim(self, agent: str, data: bytes) -> None:
        self._write(self.claim_path(agent), data)

    def _get_claim(self, agent: str) -> bytes | None:
        return self._read(self.claim_path(agent), agent, MAX_HOLDER_CHARS)

    def run_doc_path(self, generation: int) -> Path:
        return self.folder / f"run.{generation:08d}.json"

    def _create_run_doc(self, generation: int, data: bytes) -> bool:
        return self._write(self.run_doc_path(generation), data, replace=False)

    def _get_run_doc(self, generation: int) -> bytes | None:
        return self._read(self.run_doc_path(generation), "run", MAX_RUN_DOC_BYTES + 1)

    def _write(self, final: Path, data: bytes, replace: bool = True) -> bool:
        """``data`` as ``final``, whole or not at all (a temporary file fsynced, then renamed over it; with
        ``replace=False`` hard-linked to it instead, which fails when ``final`` exists: a create-only write).
        Whether ``final`` now holds ``data``."""
        # a name no other writer (process or thread, on any host) can pick: pid plus 64 random bits
        tmp = self.folder / f"{_TMP_PREFIX}{final.name}.{os.getpid()}.{secrets.token_hex(8)}"
        created = True
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            if replace:
                os.replace(tmp, final)
            else:
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    created = False
                os.unlink(tmp)
            fsync_dir(self.folder)  # the rename itself survives a crash of this node
            return created
        except BaseException as err:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # the folder itself is gone or unwritable: the error below names it
            if isinstance(err, OSError):
                raise self._failed(f"writing {final.name}", err) from None
            raise

    def _get(self, step: int, agent: str) -> tuple[bytes, str] | None:
        path = self.path(step, agent)
        data = self._read(path, agent, self.limits.max_bytes + 1)  # +1: an oversized file is seen as such
        if data is None and not self.folder.is_dir():
            # a missing folder is not a missing record: waiting on would wait for ever
            raise ExchangeBackendError(f"exchange folder {self.folder}: gone (deleted or unmounted) while reading "
                                       f"agent {agent!r}'s record of step {step}")
        return None if data is None else (data, str(path))

    def _read(self, path: Path, agent: str, limit: int) -> bytes | None:
        """At most ``limit`` bytes of ``path``; None when it does not exist."""
        # no symlink followed, and nothing but a regular file read: whoever else can write to the
        # folder could otherwise point a reader at another file or block it on a named pipe
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise refusal(agent, str(path), "record", "a symbolic link (records are plain files)") from None
            raise self._failed(f"reading {path.name}", err) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise refusal(agent, str(path), "record", "not a regular file")
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(limit)
        finally:
            os.close(fd)

    def _failed(self, what: str, err: OSError) -> OSError | ExchangeBackendError:
        """One line naming the folder: a full disk as :class:`OutOfSpaceError`, anything else as
        :class:`ExchangeBackendError` (a folder gone, unwritable, or a filesystem error)."""
        if err.errno == errno.ENOSPC:
            return OutOfSpaceError(f"exchange.dir {self.folder}: no space left on the device for {what}")
        return ExchangeBackendError(f"exchange folder {self.folder}: {what} failed: {err.strerror or err}")

    def _listdir(self) -> list[str]:
        try:
            return os.listdir(self.folder)
        except OSError as err:
            raise self._failed("listing it", err) from None

    def _steps(self, agent: str) -> list[int]:
        steps = []
        for name in self._listdir():
            m = _NAME_RE.fullmatch(name)
            if m and m.group(2) == agent:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _delete(self, step: int, agent: str) -> None:
        try:
            self.path(step, agent).unlink(missing_ok=True)
            # a temporary file left by a writer of this (step, agent) that died before its rename
            for name in self._listdir():
                if name.startswith(f"{_TMP_PREFIX}{self.path(step, agent).name}."):
                    (self.folder / name).unlink(missing_ok=True)
        except OSError as err:
            raise self._failed(f"deleting {self.path(step, agent).name}", err) from None
