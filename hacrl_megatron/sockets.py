"""Folders for AF_UNIX sockets that work under a long ``TMPDIR`` (a leaf module: standard library only).

A Unix socket's path may hold at most 107 bytes (``sun_path`` is 108 with its NUL). Python's
multiprocessing (which torch uses to share a CPU tensor's file descriptor with another process) and
Ray (its raylet and object-store sockets) put their sockets under the temporary folder, so with a
``TMPDIR`` of a hundred characters — a project under a deep home folder, a CI workspace, a path with
spaces — they fail with "AF_UNIX path too long". Here a temporary folder that is too long for the
sockets these libraries make is replaced, for their sockets only, by a private folder under the first
short system temporary folder (``/tmp``, ``/var/tmp``, ``/dev/shm``); everything else keeps ``TMPDIR``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

AF_UNIX_PATH_MAX = 107  # bytes of a socket path, without the terminating NUL (Linux sun_path is 108)
PYMP_SOCKET_CHARS = 40  # what multiprocessing appends: /pymp-xxxxxxxx/listener-xxxxxxxx and a margin
RAY_SOCKET_CHARS = 72  # what Ray appends: /session_<date>_<time>_<micros>_<pid>/sockets/plasma_store + margin
SHORT_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


def fits(base: str, suffix_chars: int) -> bool:
    """Whether sockets of ``suffix_chars`` characters under ``base`` stay within :data:`AF_UNIX_PATH_MAX`."""
    return len(os.fsencode(base)) + suffix_chars <= AF_UNIX_PATH_MAX


def short_temp_base(suffix_chars: int) -> str:
    """The temporary folder when sockets of ``suffix_chars`` characters fit under it, else the first
    writable one of :data:`SHORT_TEMP_DIRS` they fit under. Raises OSError naming ``TMPDIR`` when none does."""
    base = tempfile.gettempdir()
    if fits(base, suffix_chars):
        return base
    for candidate in SHORT_TEMP_DIRS:
        if fits(candidate, suffix_chars) and os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            return candidate
    raise OSError(f"the temporary folder {base} is too long for Unix sockets ({len(os.fsencode(base))} bytes; "
                  f"sockets need at most {AF_UNIX_PATH_MAX - suffix_chars}) and none of {list(SHORT_TEMP_DIRS)} is "
                  "writable: set TMPDIR to a shorter folder")


def use_short_multiprocessing_dir() -> str:
    """Make this process's multiprocessing socket folder short enough for its sockets, and return it.

    multiprocessing keeps one folder per process (``util.get_temp_dir``: ``mkdtemp(prefix="pymp-")``
    under ``TMPDIR``, removed at exit); when ``TMPDIR`` is too long, the folder is made under a short
    base instead, with the same removal at exit. Idempotent; a folder already chosen is kept."""
    from multiprocessing import process, util

    config = process.current_process()._config
    if config.get("tempdir") is None:
        base = short_temp_base(PYMP_SOCKET_CHARS)
        if base == tempfile.gettempdir():
            return util.get_temp_dir()
        folder = tempfile.mkdtemp(prefix="pymp-", dir=base)
        util.Finalize(None, util._remove_temp_dir, args=(shutil.rmtree, folder), exitpriority=-100)
        config["tempdir"] = folder
        logger.debug("TMPDIR is too long for Unix sockets: multiprocessing's sockets go to %s", folder)
    return config["tempdir"]


def ray_temp_dir() -> str | None:
    """A ``_temp_dir`` for a Ray cluster this process starts: None (Ray's default) when ``RAY_TMPDIR`` is
    set or its sockets fit under the temporary folder, else ``<short base>/ray-<uid>``."""
    if os.environ.get("RAY_TMPDIR"):
        return None
    base = short_temp_base(RAY_SOCKET_CHARS + len("/ray-") + 10)
    if base == tempfile.gettempdir():
        return None
    return os.path.join(base, f"ray-{os.getuid()}")
