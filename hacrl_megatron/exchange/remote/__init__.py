"""The rollout exchange between agents that train in separate jobs (docs/exchange.md).

Each job publishes a per-(step, agent) :class:`PeerRecord` — responses as text, verified rewards,
π_old log-prob sums and lengths, its positive rate, its weights version — and waits for its peers'
records of the same step through an :class:`ExchangeStore`: ``local`` (in-process),
``shared_dir`` (a folder every job can reach) or ``redis`` (a Redis server). Records are checked
JSON, optionally HMAC-signed with a shared key. Standard library only, except the ``redis``
backend (imported lazily; ``pip install -e ".[exchange]"``).
"""

from __future__ import annotations

import os

from hacrl_megatron.errors import InputError
from hacrl_megatron.exchange.remote.record import (
    DEFAULT_LIMITS,
    FORMAT,
    ExchangeRecordError,
    Limits,
    PeerRecord,
    parse_record,
)
from hacrl_megatron.exchange.remote.signing import KeyFileError, load_key
from hacrl_megatron.exchange.remote.store import ExchangeBackendError, ExchangeStore, LocalStore, WaitResult

BACKENDS = ("local", "shared_dir", "redis")


def open_store(backend: str, run_id: str, *, dir: str | os.PathLike | None = None, redis_url: str | None = None,
               redis_password_file: str | os.PathLike | None = None, redis_ca_file: str | os.PathLike | None = None,
               key_file: str | os.PathLike | None = None, limits: Limits = DEFAULT_LIMITS) -> ExchangeStore:
    """The store of ``backend`` for run ``run_id``; ``key_file``: sign and verify with that shared key.

    ``dir`` is required by ``shared_dir``, ``redis_url`` by ``redis``; a missing or unusable option
    raises :class:`~hacrl_megatron.errors.InputError` naming it.
    """
    key = load_key(key_file) if key_file is not None else None
    if backend == "local":
        return LocalStore(run_id, key=key, limits=limits)
    if backend == "shared_dir":
        if dir is None:
            raise InputError("exchange.dir: required when exchange.backend=shared_dir")
        from hacrl_megatron.exchange.remote.shared_dir import SharedDirStore

        return SharedDirStore(dir, run_id, key=key, limits=limits)
    if backend == "redis":
        if redis_url is None:
            raise InputError("exchange.redis_url: required when exchange.backend=redis")
        from hacrl_megatron.exchange.remote.redis_store import RedisStore

        return RedisStore(redis_url, run_id, password_file=redis_password_file, ca_file=redis_ca_file, key=key,
                          limits=limits)
    raise InputError(f"exchange.backend={backend!r}: must be one of {list(BACKENDS)}")


__all__ = [
    "BACKENDS",
    "DEFAULT_LIMITS",
    "ExchangeBackendError",
    "FORMAT",
    "ExchangeRecordError",
    "ExchangeStore",
    "KeyFileError",
    "Limits",
    "LocalStore",
    "PeerRecord",
    "WaitResult",
    "load_key",
    "open_store",
    "parse_record",
]
