"""Checkpoint files hashed as they are written and verified as they are read, and the writer thread.

A checkpoint's manifest lists every file's size and SHA-256 (trainer/checkpoint.py). Reading the
files back after a save to hash them doubles the checkpoint's I/O (the 9 × 8 preset writes ~2 TB),
so the bytes are hashed on their way to disk instead: :class:`HashingWriter` is the file every bulk
writer of a checkpoint writes through (megatron's tensor shards, HF weights, optimizer state, the
run state), and :attr:`HashingWriter.digest` is the manifest's entry. Only the few small metadata
files that libraries write by path (megatron's ``common.pt`` and ``metadata.json``, torch's
``.metadata``) are hashed after writing, from the page cache (:func:`hash_files`).

Reading a checkpoint back, each file is hashed as it is loaded: :func:`read_verified` reads a whole
file once, checks it and hands its bytes to the parser; :func:`verified_dcp_reads` does the same for
the files torch's distributed-checkpoint reader opens (each is hashed sequentially when opened, then
read by the loader from the page cache). A damaged file raises :class:`DamagedCheckpointError`
naming it, before its bytes are parsed.

:class:`BackgroundWrite` runs one agent's writes in a thread of this process: the training goes on
while it writes a copy of the state taken to host memory; a killed process takes its writer with it
(no forked writer outlives the trainer and writes into a checkpoint folder afterwards).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hacrl_megatron.models.convert import CheckpointMismatchError

logger = logging.getLogger(__name__)

FileDigest = dict[str, Any]  # {"size": bytes, "sha256": hex digest}, a manifest entry
_CHUNK = 1 << 22  # bytes per read while hashing a file: large enough that hashlib releases the GIL
SMALL_FILE_BYTES = 64 << 20  # a file hashed after writing larger than this is logged: it should stream
# test hook (tests/faults/test_async_checkpoint.py): the first write to a file whose path matches the glob
# HOLD_MATCH creates "<HOLD_RELEASE>.held" and waits until HOLD_RELEASE exists (at most _HOLD_LIMIT_S)
HOLD_MATCH, HOLD_RELEASE = "HACRL_TEST_HOLD_SAVE_MATCH", "HACRL_TEST_HOLD_SAVE_RELEASE"
_HOLD_LIMIT_S = 600.0
_held = threading.Event()


class DamagedCheckpointError(CheckpointMismatchError):
    """A checkpoint file is missing, truncated or corrupted; the message names the file."""


class DigestMismatchError(DamagedCheckpointError):
    """A checkpoint file differs from its manifest entry (its size or its SHA-256): damaged on disk."""


class SaveAborted(Exception):
    """A background write stopped because its checkpoint was abandoned (the run is stopping)."""


def _digest(size: int, sha: Any) -> FileDigest:
    return {"size": int(size), "sha256": sha.hexdigest()}


class HashingWriter:
    """A binary file opened for writing whose bytes are SHA-256-hashed as they are written.

    Writes are sequential (``seek`` only to the current position), so the running hash is the
    file's hash; ``close`` flushes and fsyncs (in the writer's thread, off the training's path).
    ``abort``: an event that, once set, makes the next write raise :class:`SaveAborted`.
    """

    def __init__(self, path: str | os.PathLike, abort: threading.Event | None = None) -> None:
        self.path = os.fspath(path)
        self._file = open(self.path, "wb")
        self._sha = hashlib.sha256()
        self._size = 0
        self._abort = abort
        self._hold = bool(os.environ.get(HOLD_MATCH)) and fnmatch.fnmatch(self.path, os.environ[HOLD_MATCH])

    def write(self, data: Any) -> int:
        if self._abort is not None and self._abort.is_set():
            raise SaveAborted(f"{self.path}: the checkpoint was abandoned")
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self._file.write(view)
        self._sha.update(view)
        self._size += view.nbytes
        if self._hold:
            self._hold = False
            _hold_for_test(self.path)
        return view.nbytes

    def tell(self) -> int:
        return self._size

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        target = {os.SEEK_SET: offset, os.SEEK_CUR: self._size + offset, os.SEEK_END: self._size + offset}[whence]
        if target != self._size:
            raise OSError(f"{self.path}: a hashing writer writes sequentially (seek to {target} of {self._size})")
        return self._size

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    @property
    def digest(self) -> FileDigest:
        """The manifest entry of what was written: ``{"size": bytes, "sha256": hex}``."""
        return _digest(self._size, self._sha)

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # a failed write: no fsync of a file the save removes anyway
            self._file.close()


def write_bytes(path: str | os.PathLike, data: Any, abort: threading.Event | None = None) -> FileDigest:
    """Write ``data`` (bytes or any buffer) to ``path`` through a :class:`HashingWriter`; its digest."""
    with HashingWriter(path, abort) as f:
        f.write(data)
    return f.digest


def hash_file(path: str | os.PathLike) -> FileDigest:
    """Size and SHA-256 of a file on disk (one sequential read)."""
    sha, size, buf = hashlib.sha256(), 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            sha.update(view[:n])
            size += n
    return _digest(size, sha)


def hash_files(folder: str | os.PathLike, skip: set[str]) -> dict[str, FileDigest]:
    """Digests of the files under ``folder`` (paths relative to it) not in ``skip``: the small files that
    libraries write by path. One larger than :data:`SMALL_FILE_BYTES` is logged (it should stream)."""
    folder = Path(folder)
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel not in skip:
            out[rel] = hash_file(p)
            if out[rel]["size"] > SMALL_FILE_BYTES:
                logger.warning("%s: %d MB hashed after writing (a second read): it should be written through "
                               "a HashingWriter", p, out[rel]["size"] >> 20)
    return out


def prefixed(prefix: str, digests: dict[str, FileDigest]) -> dict[str, FileDigest]:
    """``digests`` with ``prefix/`` before every relative path (an agent's files inside the checkpoint)."""
    return {f"{prefix}/{rel}": d for rel, d in digests.items()}


def _mismatch(path: str, want: FileDigest, size: int) -> DigestMismatchError:
    if size != want["size"]:
        return DigestMismatchError(f"{path} is {size} bytes, the manifest says {want['size']} (truncated?)")
    return DigestMismatchError(f"{path} does not match its SHA-256 in MANIFEST.json (corrupted)")


def check_digest(path: str | os.PathLike, want: FileDigest | None) -> None:
    """Raise :class:`DamagedCheckpointError` naming ``path`` when it differs from ``want`` (None: unchecked)."""
    if want is None:
        return
    got = hash_file(path)
    if got != want:
        raise _mismatch(os.fspath(path), want, got["size"])


def read_verified(path: str | os.PathLike, want: FileDigest | None) -> bytes:
    """The bytes of ``path``, read once and checked against ``want`` (None: not checked) before use."""
    data = Path(path).read_bytes()
    if want is not None and (len(data) != want["size"] or hashlib.sha256(data).hexdigest() != want["sha256"]):
        raise _mismatch(os.fspath(path), want, len(data))
    return data


def _hash_stream(stream: Any) -> FileDigest:
    sha, size = hashlib.sha256(), 0
    while chunk := stream.read(_CHUNK):
        sha.update(chunk)
        size += len(chunk)
    stream.seek(0)
    return _digest(size, sha)


@contextlib.contextmanager
def verified_dcp_reads(folder: str | os.PathLike,
                       expected: dict[str, FileDigest] | None) -> Iterator[list[DigestMismatchError]]:
    """While active, every file under ``folder`` that torch's distributed-checkpoint reader opens
    (megatron's ``.distcp`` shards and ``.metadata``) is hashed when opened, once, and checked against
    ``expected`` (paths relative to ``folder``) before the reader parses it; the reader then reads it
    from the page cache. ``expected`` None: nothing is checked. Yields the list of mismatches found:
    each is raised where it is found, but megatron replaces some errors by its own (a failed metadata
    read becomes ``metadata is None``), so the caller raises the first one after the load."""
    found: list[DigestMismatchError] = []
    if not expected:
        yield found
        return
    from torch.distributed.checkpoint.filesystem import FileSystem

    root, checked, lock = Path(folder).resolve(), set(), threading.Lock()
    original = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            full = Path(path).resolve()
            rel = full.relative_to(root).as_posix() if full.is_relative_to(root) else None
            if "r" in mode and rel in expected:
                with lock:
                    first = rel not in checked
                    checked.add(rel)
                if first:
                    got = _hash_stream(stream)
                    if got != expected[rel]:
                        found.append(_mismatch(str(full), expected[rel], got["size"]))
                        raise found[-1]
            yield stream

    FileSystem.create_stream = create_stream
    try:
        yield found
    finally:
        FileSystem.create_stream = original


def _hold_for_test(path: str) -> None:
    """The kill -9 test's pause: announce, then wait for the release file (bounded), once per process."""
    if _held.is_set():
        return
    _held.set()
    release = Path(os.environ[HOLD_RELEASE])
    Path(f"{release}.held").write_text(path)
    deadline = time.monotonic() + _HOLD_LIMIT_S
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


class BackgroundWrite:
    """``job(abort)`` run in a daemon thread of this process; :meth:`result` waits and returns (or
    raises) what it returned. ``job`` writes through :class:`HashingWriter` files given ``abort``, so
    :meth:`abandon` stops it at its next write."""

    def __init__(self, job: Callable[[threading.Event], dict[str, FileDigest]], name: str) -> None:
        self._abort = threading.Event()
        self._value: dict[str, FileDigest] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"hacrl-save-{name}", daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[threading.Event], dict[str, FileDigest]]) -> None:
        try:
            self._value = job(self._abort)
        except BaseException as err:  # noqa: BLE001 - handed to the thread that calls result()
            self._error = err

    def result(self) -> dict[str, FileDigest]:
        """Wait for the write; its digests (relative path → size and SHA-256), or its error re-raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return dict(self._value or {})

    def abandon(self, wait_s: float = 10.0) -> None:
        """Stop the write at its next chunk and wait up to ``wait_s`` seconds for the thread to end."""
        self._abort.set()
        self._thread.join(wait_s)
