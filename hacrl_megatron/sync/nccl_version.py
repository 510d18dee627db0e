"""One NCCL version on both sides of a weight-update group, checked before the group opens.

NCCL refuses a communicator whose ranks run different library versions ("Mismatched NCCL version
detected"), and then both sides fail inside the first collective with an error that names neither
environment. The trainer and the engines usually live in different Python environments (an image's
trainer uses the base image's torch and NCCL, the SGLang and vLLM virtual environments their own
``torch`` and ``nvidia-nccl-*`` wheels), so before rank 0 opens a group with NCCL:

* the trainer side reports ``torch.cuda.nccl.version()`` in the process that joins the group;
* each engine reports the same call run by its server's interpreter (the first word of a
  ``python -m ...`` server command line) with the server's environment, on the server's node (a
  Ray-placed server answers through its actor); results are cached per interpreter and library
  path, so a server restart costs nothing;
* a difference raises :class:`NCCLVersionMismatch`: one line naming both versions and how to align
  them. An engine whose version cannot be read (a custom command, a torch without NCCL) is not
  checked; NCCL's own error remains the last word there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hacrl_megatron.errors import InputError
from hacrl_megatron.rollout.nccl_probe import (  # noqa: F401  (the engine side's reading, re-exported)
    LIBRARY_ENV,
    PROBE,
    PROBE_TIMEOUT_S,
    Version,
    as_version,
    interpreter_nccl_version,
    local_nccl_version,
    server_interpreter,
    server_nccl_version,
)

log = logging.getLogger(__name__)

class NCCLVersionMismatch(InputError):
    """The trainer's and an engine's NCCL differ; the message names both and how to align them."""


def text(version: Version | None) -> str:
    return "unknown" if version is None else ".".join(map(str, version))


def engine_nccl_version(engine: Any) -> Version | None:
    """An engine client's NCCL: through its server handle (a Ray-placed server's handle asks its
    actor, on the server's node); None when this process holds no handle or cannot tell."""
    server = getattr(engine, "server", None)
    if server is None:
        return None
    if callable(getattr(server, "nccl_version", None)):
        return as_version(server.nccl_version())
    return server_nccl_version(server)


def engine_versions(engines: Sequence[Any]) -> dict[str, Version | None]:
    """{base_url: NCCL version or None} of every engine (read where the server handles are)."""
    return {e.base_url: engine_nccl_version(e) for e in engines}


def mismatch_message(group: str, trainer: Version, engine_name: str, engine_url: str, engine: Version,
                     cuda: str | None = None) -> str:
    """One line: both versions, why it stops, and the two ways to align them."""
    wheel = f"nvidia-nccl-cu{cuda.split('.')[0]}" if cuda and cuda[0].isdigit() else "nvidia-nccl-cu12"
    return (f"weight group {group!r}: NCCL {text(trainer)} on the trainer (torch.cuda.nccl.version() of the "
            f"process that opens the group) but NCCL {text(engine)} on engine {engine_name} ({engine_url}); NCCL "
            f"refuses a group whose ranks differ. Align them: `pip install {wheel}=={text(trainer)}` in the "
            f"engine's environment (rollout.<engine>.python), or have both load one library: link the "
            f"engine environment's nvidia/nccl/lib/libnccl.so.2 to the trainer's (the image does, "
            f"tools/image/nccl_align.py)")


def check_nccl_versions(group: str, engines: Sequence[Any], known: Mapping[str, Version | None] | None = None,
                        local: Callable[[], Version | None] | None = None) -> Version | None:
    """Raise :class:`NCCLVersionMismatch` when an engine's NCCL differs from this process's.

    ``known``: versions already read where the server handles are ({base_url: version}, e.g. by the
    controller for a group that a Ray agent's rank 0 opens); other engines are read here through
    their handles. ``local``: this process's version (default :func:`local_nccl_version`). Returns
    this process's version (None: no NCCL here, nothing checked).
    """
    mine = (local or local_nccl_version)()
    if mine is None:
        return None
    known = known or {}
    for engine in engines:
        theirs = known[engine.base_url] if engine.base_url in known else engine_nccl_version(engine)
        if theirs is not None and theirs != mine:
            import torch

            raise NCCLVersionMismatch(mismatch_message(group, mine, getattr(engine, "name", "?"), engine.base_url,
                                                       theirs, torch.version.cuda))
    return mine
