"""The loop's checkpoints: when a save waits for its write (``checkpoint.async_save``), one save in flight.

A synchronous save holds the step for the whole write. An asynchronous one returns once every
agent's state is copied to host memory (trainer/checkpoint.py, :func:`begin_checkpoint`); the
writers then run while the next steps train, and the checkpoint is finished — made complete and
visible to a resume — at the next save, at the end of the run, or after a run that failed with an
error. docs/checkpoints.md.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from hacrl_megatron.trainer.checkpoint import PendingCheckpoint, begin_checkpoint

logger = logging.getLogger(__name__)


def async_saves(exp: Any) -> bool:
    """``checkpoint.async_save`` resolved: as given, else (null) true when this process sees a CUDA device.
    On CPU an asynchronous save clones the whole state in memory and its writer competes with the
    training for the same cores (benchmarks/bench_checkpoint.py), so it is opt-in there."""
    chosen = exp.checkpoint.async_save
    return bool(torch.cuda.is_available()) if chosen is None else bool(chosen)


class RunCheckpoints:
    """The run's checkpoints under ``root``, at most one in flight. ``background``
    (``checkpoint.async_save``): :meth:`save` returns once every agent's state is copied, the write
    goes on during the next steps and is finished at the next :meth:`save` or :meth:`finish`; else
    :meth:`save` finishes it before returning. ``wait_s``: seconds the loop waited in saves since the
    last :meth:`take_wait_s` (the copy, plus the finishing of an earlier save; the whole write when
    not in the background)."""

    def __init__(self, root: str | os.PathLike, keep: int, background: bool) -> None:
        self.root, self.keep, self.background = Path(root), keep, background
        self.pending: PendingCheckpoint | None = None
        self.wait_s = 0.0

    def save(self, step: int, runtimes, state: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            self.finish()
            self.pending = begin_checkpoint(self.root, step, runtimes, state, self.keep, self.background)
            if not self.background:
                self.finish()
        finally:
            self.wait_s += time.perf_counter() - started

    def finish(self) -> Path | None:
        """Complete the checkpoint in flight, if any; its folder."""
        pending, self.pending = self.pending, None
        return pending.finish() if pending is not None else None

    def abandon(self) -> None:
        """Discard the checkpoint in flight (the run failed or was interrupted): the previous one stays the
        resume point."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.abandon()

    def settle(self, failure: BaseException) -> None:
        """After the run stopped on ``failure``: the save in flight is finished when the run failed with
        an error (its state was copied before the failure: a valid resume point, as a synchronous save
        would have left), abandoned when it was interrupted (Ctrl-C, SIGTERM: stop now; the previous
        checkpoint stays the resume point) or cannot be finished."""
        if isinstance(failure, Exception) and self.pending is not None:
            try:
                self.finish()
                return
            except Exception:  # noqa: BLE001 - the run's own error stays the one reported
                logger.warning("the checkpoint in flight could not be finished after the run failed", exc_info=True)
        self.abandon()

    def take_wait_s(self) -> float | None:
        """:attr:`wait_s`, reset to 0; None when the loop has not waited for a save since the last call."""
        waited, self.wait_s = self.wait_s, 0.0
        return waited or None
