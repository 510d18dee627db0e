"""HMAC-SHA256 signatures of exchange records with a key shared by the run's jobs.

A shared folder or a Redis database may be writable by more people than the run's jobs; with a key
(``exchange.key_file``: a file only its owner — and group — may read) each job signs what it
publishes and refuses any record whose signature is missing or wrong, so nobody without the key can
inject samples into another agent's training. The signature covers the record's canonical JSON
(sorted keys, ASCII, no spaces) without the signature field itself.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from pathlib import Path
from typing import Any

from hacrl_megatron.errors import InputError

SIGNATURE_FIELD = "hmac_sha256"
MIN_KEY_BYTES = 16  # a shorter secret is guessable; `openssl rand -hex 32` gives 64
MIN_DISTINCT_KEY_BYTES = 8  # fewer distinct byte values is a pattern, not a secret (32 random hex digits hold ~15)


class KeyFileError(InputError):
    """A key or password file that is missing, unreadable, too short or readable by every user."""


def load_key(path: str | os.PathLike) -> bytes:
    """The shared HMAC key (``exchange.key_file``): :func:`load_secret` with at least 16 bytes, of at least
    :data:`MIN_DISTINCT_KEY_BYTES` distinct values (16 equal bytes, or ``abab...``, is refused)."""
    key = load_secret(path, "exchange.key_file", MIN_KEY_BYTES)
    distinct = len(set(key))
    if distinct < MIN_DISTINCT_KEY_BYTES:
        raise KeyFileError(f"exchange.key_file {path}: {len(key)} bytes of only {distinct} distinct value(s), a "
                           f"pattern anyone can guess (at least {MIN_DISTINCT_KEY_BYTES} needed); make one with "
                           "`openssl rand -hex 32 > FILE`")
    return key


def load_secret(path: str | os.PathLike, what: str, min_bytes: int) -> bytes:
    """A secret's bytes from file ``path`` without surrounding whitespace.

    Refuses (one line naming ``what`` and the file) a file that every user may read or write (mode
    o+r or o+w: the secret would be none, or replaceable), one that is not a regular file, and a
    secret shorter than ``min_bytes``.
    """
    path = Path(path)
    try:
        info = path.stat()
    except OSError as err:
        raise KeyFileError(f"{what} {path}: cannot read it ({err.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise KeyFileError(f"{what} {path}: not a regular file")
    if info.st_mode & (stat.S_IROTH | stat.S_IWOTH):
        raise KeyFileError(f"{what} {path}: readable or writable by every user "
                           f"(mode {stat.S_IMODE(info.st_mode):o}); run `chmod 600 {path}`")
    try:
        secret = path.read_bytes().strip()
    except OSError as err:
        raise KeyFileError(f"{what} {path}: cannot read it ({err.strerror})") from None
    if len(secret) < min_bytes:
        raise KeyFileError(f"{what} {path}: {len(secret)} bytes, at least {min_bytes} needed"
                           + (" (e.g. `openssl rand -hex 32 > FILE`)" if min_bytes > 1 else ""))
    return secret


def canonical(body: dict[str, Any]) -> bytes:
    """The bytes a signature covers: ``body`` without its signature, as compact sorted ASCII JSON.

    Python's float repr round-trips exactly, so a parsed record re-serialises to the same bytes.
    """
    unsigned = {k: v for k, v in body.items() if k != SIGNATURE_FIELD}
    return json.dumps(unsigned, sort_keys=True, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def sign(body: dict[str, Any], key: bytes) -> str:
    """Hex HMAC-SHA256 of :func:`canonical` ``(body)`` under ``key``."""
    return hmac.new(key, canonical(body), hashlib.sha256).hexdigest()


def verify(body: dict[str, Any], key: bytes) -> str:
    """"" when ``body`` carries a valid signature under ``key``, else what is wrong (for the refusal line)."""
    given = body.get(SIGNATURE_FIELD)
    if given is None:
        return "missing, but the exchange is configured with a key (unsigned records are refused)"
    if not isinstance(given, str):
        return f"a {type(given).__name__}, expected a hex string"
    try:
        expected = sign(body, key)
    except (TypeError, ValueError):  # a value json cannot write canonically (NaN): it cannot have been signed
        return "does not match the record (a value cannot be serialised canonically)"
    if not hmac.compare_digest(given.encode("ascii", "replace"), expected.encode()):
        return "does not match the record (forged, altered, or signed with another key)"
    return ""
