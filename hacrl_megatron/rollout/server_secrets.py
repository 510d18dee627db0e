"""Keeping an engine server's API key off command lines and out of logs (``rollout.sglang.api_key_file``).

- The key reaches SGLang through its ``--config FILE.yaml`` option, not ``--api-key KEY`` (which any
  user of the node reads in the process list): :class:`KeyConfig` writes ``{"api-key": ...}`` (JSON is
  YAML) into a private folder of ``$TMPDIR`` (folder 0700, file 0600, never in the run folder) right
  before the server starts and removes it once the server has read it (healthy, or failed).
- SGLang prints its resolved arguments, the key included, into its log at start-up: a server with a
  key writes into a pipe, and :class:`RedactingPump` copies it line by line into the log file with
  every occurrence of the key replaced by :data:`REDACTED`.
- Server logs are created 0600 (:func:`open_private_log`): they describe the run's engines.

Standard library only.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import IO

REDACTED = "<api-key redacted>"


def redact(text: str, secret: str | None) -> str:
    """``text`` with every occurrence of ``secret`` replaced by :data:`REDACTED`."""
    return text.replace(secret, REDACTED) if secret else text


def open_private_log(path: Path) -> IO[bytes]:
    """``path`` opened for appending (binary), created readable by its owner only (0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


class KeyConfig:
    """A YAML file holding the API key for SGLang's ``--config``, alive between :meth:`write` and
    :meth:`discard` (the server reads it while it parses its arguments)."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.path: Path | None = None

    def write(self) -> Path:
        """Create the file (a fresh private folder each time); returns its path."""
        self.discard()
        folder = Path(tempfile.mkdtemp(prefix="hacrl-sglang-key-"))  # mkdtemp: mode 0700
        path = folder / "api_key.yaml"  # SGLang refuses a --config file without a .yaml suffix
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"api-key": self.secret}) + "\n")  # the key is the flag SGLang builds: --api-key
        self.path = path
        return path

    def discard(self) -> None:
        """Remove the file and its folder (idempotent)."""
        path, self.path = self.path, None
        if path is not None:
            shutil.rmtree(path.parent, ignore_errors=True)


class RedactingPump:
    """Copies a server's output pipe into its log, line by line, with the key redacted (a daemon
    thread: it ends when the server closes its output)."""

    def __init__(self, pipe: IO[bytes], log_path: Path, secret: str) -> None:
        self._pipe, self._log_path, self._secret = pipe, log_path, secret.encode()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"redact-{log_path.name}")
        self._thread.start()

    def _run(self) -> None:
        with open_private_log(self._log_path) as log, self._pipe:
            for line in iter(self._pipe.readline, b""):
                log.write(line.replace(self._secret, REDACTED.encode()))
                log.flush()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the server's output is closed and copied."""
        self._thread.join(timeout)
