"""What every engine that runs as servers shares: one GPU group per server, and starting them together."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def gpu_groups(gpu_ids: list[int], tp: int, key: str = "tp") -> list[list[int] | None]:
    """One GPU list per server: consecutive groups of ``tp`` ids; ``[None]`` (inherit) when empty.
    ``key`` names the config field of ``tp`` in the error (``rollout.sglang.tp``, ``rollout.vllm.tp``)."""
    if not gpu_ids:
        return [None]
    if len(gpu_ids) % tp:
        raise ValueError(f"gpu_groups: {len(gpu_ids)} GPU ids are not a multiple of {key}={tp}")
    return [list(gpu_ids[k: k + tp]) for k in range(0, len(gpu_ids), tp)]


def start_all(servers: Sequence[Any], label: str = "server") -> None:
    """Start every server (``start()`` / ``stop()``) concurrently; if one fails, stop the others and re-raise."""
    with ThreadPoolExecutor(max_workers=len(servers), thread_name_prefix=f"{label}-start") as pool:
        futures = [pool.submit(s.start) for s in servers]
        errors = [f.exception() for f in futures]
    if any(errors):
        for s in servers:
            s.stop()
        raise next(e for e in errors if e is not None)
