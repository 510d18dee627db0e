"""What NCCL an engine server's interpreter loads, read on the server's node.

A server started as ``<python> -m <module> ...`` runs in its own Python environment (the image's SGLang
and vLLM virtual environments bring their own ``torch`` and ``nvidia-nccl-*`` wheels), so its NCCL is
read by running that interpreter once with the server's library variables (cached per interpreter and
variables). The comparison with the trainer's NCCL before a weight-update group opens is
``sync/nccl_version.py``'s; this module is the engine side's reading, which Ray-placed servers run
on their own node (``rollout/engine_actor.py``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

Version = tuple[int, int, int]
log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 180.0  # importing torch in a cold environment on a shared file system can take minutes
# run by the engine's interpreter: its torch's NCCL (ncclGetVersion needs no GPU), or null without one
PROBE = ("import json, torch\n"
         "try:\n    v = list(torch.cuda.nccl.version())[:3]\n"
         "except (AttributeError, RuntimeError):\n    v = None\n"
         "print(json.dumps({'nccl': v}))")
LIBRARY_ENV = ("LD_LIBRARY_PATH", "LD_PRELOAD", "NCCL_LIB_DIR", "VLLM_NCCL_SO_PATH", "SGLANG_NCCL_SO_PATH")


def as_version(raw: Any) -> Version | None:
    """(major, minor, patch) of ``torch.cuda.nccl.version()``'s tuple (a suffix, if any, dropped:
    NCCL compares the numeric version code only)."""
    return None if raw is None else tuple(int(x) for x in list(raw)[:3])  # type: ignore[return-value]


def local_nccl_version() -> Version | None:
    """This process's NCCL, as torch loaded it; None for a torch built without NCCL (CPU wheels)."""
    import torch

    try:
        return as_version(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        return None


@functools.lru_cache(maxsize=32)
def _probe(python: str, library_env: tuple[tuple[str, str], ...]) -> Version | None:
    env = {k: v for k, v in os.environ.items() if k not in LIBRARY_ENV}
    env.update(library_env)
    try:
        res = subprocess.run([python, "-c", PROBE], env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        if res.returncode != 0:
            raise RuntimeError((res.stderr.strip().splitlines() or ["no output"])[-1])
        return as_version(json.loads(res.stdout.strip().splitlines()[-1])["nccl"])
    except (OSError, subprocess.TimeoutExpired, RuntimeError, ValueError, KeyError, IndexError) as err:
        log.warning("NCCL version of %s unknown (%s: %s): engines using it are not checked", python,
                    type(err).__name__, err)
        return None


def interpreter_nccl_version(python: str, env: Mapping[str, str] | None = None) -> Version | None:
    """The NCCL that ``python``'s torch loads with ``env``'s library variables (cached per interpreter
    and variables); None when its torch has no NCCL or it cannot be run (logged once)."""
    env = os.environ if env is None else env
    library_env = tuple((k, env[k]) for k in LIBRARY_ENV if k in env)
    if str(python) == sys.executable and library_env == tuple((k, os.environ[k]) for k in LIBRARY_ENV
                                                               if k in os.environ):
        return local_nccl_version()  # this very interpreter and libraries: no subprocess needed
    return _probe(str(python), library_env)


def server_interpreter(server: Any) -> str | None:
    """The interpreter of a server started with ``<python> -m <module> ...``; None for other commands."""
    try:
        cmd = list(server.command_line())
    except Exception:  # noqa: BLE001  (a handle without a command line: nothing to read)
        return None
    return str(cmd[0]) if len(cmd) >= 3 and cmd[1] == "-m" else None


def server_nccl_version(server: Any) -> Version | None:
    """The NCCL a server's interpreter loads, read on this node (the server's own environment when it
    has one, e.g. ``VLLMServer.environment()``)."""
    python = server_interpreter(server)
    if python is None:
        return None
    env = server.environment() if callable(getattr(server, "environment", None)) else None
    return interpreter_nccl_version(python, env)
