"""``redis`` backend: records on a Redis server, for jobs that share no filesystem.

Keys (namespace per run): ``hacrl:exchange:<run_id>:rec:<step:08d>:<agent>`` holds a record's JSON
bytes (one SET: Redis applies it whole, a reader never sees a part), and
``hacrl:exchange:<run_id>:steps:<agent>`` is a sorted set of the steps ``agent`` has records of
(pruning deletes from it without scanning the database). A publish writes both in one MULTI/EXEC.

The password comes from a file (never the URL: URLs end up in logs and configs); ``rediss://``
URLs connect over TLS and verify the server's certificate (``ca_file`` names the CA bundle when
the server's CA is not a system one). Needs the ``redis`` package: ``pip install -e ".[exchange]"``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hacrl_megatron.errors import InputError
from hacrl_megatron.exchange.remote.record import DEFAULT_LIMITS, Limits
from hacrl_megatron.exchange.remote.signing import KeyFileError, load_secret
from hacrl_megatron.exchange.remote.store import (
    MAX_HOLDER_CHARS,
    MAX_RUN_DOC_BYTES,
    ExchangeBackendError,
    ExchangeStore,
)

NAMESPACE = "hacrl:exchange"


def _import_redis() -> Any:
    try:
        import redis
    except ImportError:
        raise InputError('exchange.backend=redis needs the redis package: pip install -e ".[exchange]"') from None
    return redis


def check_url(url: str) -> str:
    """``url`` if it is a redis:// or rediss:// URL without a password in it, else one line naming it."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise InputError(f"exchange.redis_url {url!r}: must be redis://HOST:PORT[/DB] or rediss://HOST:PORT[/DB] (TLS)")
    if parts.password is not None:
        raise InputError("exchange.redis_url: carries a password; put it in a file and name it in "
                         "exchange.redis_password_file (URLs end up in logs)")
    return url


class RedisStore(ExchangeStore):
    """Records of run ``run_id`` on the Redis server at ``url``.

    ``password_file``: a file with the server's password (``requirepass``), not readable by every user.
    ``ca_file``: CA bundle to verify a ``rediss://`` server with. ``timeout_s``: socket timeout per command.
    """

    backend = "redis"

    def __init__(self, url: str, run_id: str, *, password_file: str | os.PathLike | None = None,
                 ca_file: str | os.PathLike | None = None, key: bytes | None = None,
                 limits: Limits = DEFAULT_LIMITS, timeout_s: float = 10.0) -> None:
        super().__init__(run_id, key=key, limits=limits)
        self.url = check_url(url)  # the URL's own mistakes are named first, with or without the package
        redis = _import_redis()
        self._errors = redis.RedisError
        options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        if password_file is not None:
            try:
                options["password"] = load_secret(password_file, "exchange.redis_password_file", 1).decode()
            except UnicodeDecodeError:
                raise KeyFileError(f"exchange.redis_password_file {password_file}: not UTF-8 text") from None
        if urlsplit(url).scheme == "rediss" and ca_file is not None:
            if not Path(ca_file).is_file():
                raise InputError(f"exchange.redis_ca_file {ca_file}: no such file")
            options["ssl_ca_certs"] = str(ca_file)
        self._client = redis.Redis.from_url(url, **options)
        self._call("PING", self._client.ping)

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._errors as err:
            raise ExchangeBackendError(f"exchange redis server {self.url}: {what} failed: "
                                       f"{type(err).__name__}: {err}") from None

    def _record_key(self, step: int, agent: str) -> str:
        return f"{NAMESPACE}:{self.run_id}:rec:{step:08d}:{agent}"

    def _steps_key(self, agent: str) -> str:
        return f"{NAMESPACE}:{self.run_id}:steps:{agent}"

    def _put(self, step: int, agent: str, data: bytes) -> None:
        pipe = self._client.pipeline(transaction=True)
        pipe.set(self._record_key(step, agent), data)
        pipe.zadd(self._steps_key(agent), {str(step): step})
        self._call("publish", pipe.execute)

    def _get(self, step: int, agent: str) -> tuple[bytes, str] | None:
        key = self._record_key(step, agent)
        # the size first: of a hostile writer's huge value only max_bytes + 1 bytes are transferred
        # (parse_record then refuses it by size, naming the author), as the shared_dir backend reads files
        size = self._call("STRLEN", self._client.strlen, key)
        if size > self.limits.max_bytes:
            data = self._call("GETRANGE", self._client.getrange, key, 0, self.limits.max_bytes)
        else:
            data = self._call("GET", self._client.get, key)
        return None if data is None else (bytes(data), key)

    def _steps(self, agent: str) -> list[int]:
        members = self._call("ZRANGE", self._client.zrange, self._steps_key(agent), 0, -1)
        return sorted(int(m) for m in members)

    def _delete(self, step: int, agent: str) -> None:
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._record_key(step, agent))
        pipe.zrem(self._steps_key(agent), str(step))
        self._call("prune", pipe.execute)

    def _claim_key(self, agent: str) -> str:
        return f"{NAMESPACE}:{self.run_id}:claim:{agent}"

    def _put_claim(self, agent: str, data: bytes) -> None:
        self._call("claim", self._client.set, self._claim_key(agent), data)

    def _get_claim(self, agent: str) -> bytes | None:
        data = self._call("GETRANGE", self._client.getrange, self._claim_key(agent), 0, MAX_HOLDER_CHARS - 1)
        return bytes(data) if data else None

    def _run_doc_key(self, generation: int) -> str:
        return f"{NAMESPACE}:{self.run_id}:run:{generation:08d}"

    def _create_run_doc(self, generation: int, data: bytes) -> bool:
        key = self._run_doc_key(generation)
        return bool(self._call("SET NX", lambda: self._client.set(key, data, nx=True)))

    def _get_run_doc(self, generation: int) -> bytes | None:
        key = self._run_doc_key(generation)
        if not self._call("EXISTS", self._client.exists, key):
            return None
        return bytes(self._call("GETRANGE", self._client.getrange, key, 0, MAX_RUN_DOC_BYTES))

    def close(self) -> None:
        self._client.close()
