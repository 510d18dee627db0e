"""Every agent at once: run one stage's per-agent work concurrently where it runs outside this process.

A stage of the step (rollout, the π_old passes, weight sync) does the same work for every agent.
Work whose compute happens elsewhere (an SGLang server, a Ray worker group) only waits on I/O in
this process, so it runs in a thread per agent and the stage takes as long as the slowest agent,
not the sum (docs/architecture.md, "Every stage runs all agents at once"). Work that computes in this
process (the in-process HF engine, a local Megatron agent) runs one agent after another in the
calling thread meanwhile: megatron-core keeps its parallel state in process globals, and seeded HF
sampling draws from torch's process-wide RNG, so two of them must never interleave.

An object says where it runs with ``runs_in_process`` (default True: the safe choice for an
object that does not say).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def runs_in_process(*parts: Any) -> bool:
    """True when any of ``parts`` (an engine, a trainer) computes in this process."""
    return any(getattr(p, "runs_in_process", True) for p in parts)


def for_each(items: Sequence[T], work: Callable[[T], R], in_process: Callable[[T], bool]) -> list[R]:
    """``[work(item) for item in items]``, with the items whose ``in_process(item)`` is False run in
    threads of their own while the others run here, one after another. Waits for every item; the
    first error in ``items`` order is raised after all have finished (none is left running)."""
    remote = [i for i, item in enumerate(items) if not in_process(item)]
    if len(remote) == 0 or (len(remote) == 1 and len(items) == 1):
        return [work(item) for item in items]
    results: list[Any] = [None] * len(items)
    errors: dict[int, BaseException] = {}
    with ThreadPoolExecutor(max_workers=len(remote), thread_name_prefix="hacrl-agent") as pool:
        futures: dict[int, Future] = {i: pool.submit(work, items[i]) for i in remote}
        for i, item in enumerate(items):
            if i in futures:
                continue
            try:
                results[i] = work(item)
            except BaseException as err:  # noqa: BLE001 - re-raised below, after the threads finished
                errors[i] = err
        for i, future in futures.items():
            try:
                results[i] = future.result()
            except BaseException as err:  # noqa: BLE001
                errors[i] = err
    if errors:
        raise errors[min(errors)]
    return results
