"""What every engine that runs as servers shares: one GPU group per server, starting them together, and
the client side of a server's lifecycle (health, waiting for it, liveness, restart)."""

from __future__ import annotations

import time
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


class ServerLifecycle:
    """Health, liveness and restart of an HTTP engine client (SGLang, vLLM). The client sets ``error``
    (its error class), ``kind`` (its engine's name in messages) and ``health_timeout_s``, and has
    ``_request(route, payload, method)``, ``base_url``, ``name``, ``server`` (the handle of a server this
    process started, or None) and ``restarts``."""

    error: type[Exception] = RuntimeError
    kind = "engine"
    health_timeout_s = 300.0

    def health(self) -> bool:
        """True when ``GET /health`` answers 200."""
        try:
            self._request("/health", None, "GET")
        except self.error:
            return False
        return True

    def wait_until_healthy(self, timeout: float | None = None, interval: float = 1.0) -> None:
        """Poll ``/health`` until it answers; raise ``error`` after ``timeout`` seconds (the client's default)."""
        timeout = self.health_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                raise self.error(f"{self.kind} server {self.base_url} not healthy after {timeout:.0f} s")
            time.sleep(interval)

    def alive(self) -> bool:
        """The server answers (and, if this process started it, its process is running)."""
        if self.server is not None and not self.server.is_running():
            return False
        return self.health()

    def restart(self) -> None:
        """Restart the server this process started (it comes back with its initial weights)."""
        if self.server is None:
            raise self.error(f"{self.kind} engine {self.name} ({self.base_url}): no server handle to restart")
        self.server.restart()
        self.restarts += 1
