"""The non-finite guard: a step whose loss, gradient norm or synced weights are not finite stops the
run before that step's checkpoint is written, so the previous checkpoint stays the newest.

:func:`guarded_step` wraps one training step (``loop._train`` calls it instead of ``train_step``):

- a Megatron optimizer that finds inf/NaN gradients refuses its update and raises
  ``FloatingPointError``; it is reported as the step's divergence;
- every learner's ``<agent>/hacpo/loss`` and, when gradients are clipped (``train.grad_clip > 0``:
  only then does megatron-core compute the norm), ``<agent>/hacpo/grad_norm``, averaged over the
  step's M updates, must be finite;
- ``<agent>/sync_logp_diff`` must be finite: the engine scores a probe with the updated weights, so
  an update that left inf/NaN weights (a finite loss, then an overflow) is caught in the same step.

The error names the agent, the step, the metric and its value; the CLI adds the newest checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or weights; names the agent, step and value."""


def check_finite_step(step: int, metrics: dict[str, float], names: list[str], grad_clip: float) -> None:
    """Raise :class:`NonFiniteError` when a guarded metric of step ``step`` (1-based) is not finite."""
    suffixes = ["hacpo/loss", "sync_logp_diff"] + (["hacpo/grad_norm"] if grad_clip > 0 else [])
    for name in names:
        bad = [(s, metrics[f"{name}/{s}"]) for s in suffixes
               if f"{name}/{s}" in metrics and not math.isfinite(metrics[f"{name}/{s}"])]
        if bad:
            values = ", ".join(f"{key} = {value}" for key, value in bad)
            raise NonFiniteError(f"training diverged: agent {name}, step {step}: {values}; stopped before step "
                                 f"{step}'s checkpoint (lower agents.*.lr or train.grad_clip, then resume)")


def guarded_step(run: Any, train_step: Callable[[Any], dict[str, float]]) -> dict[str, float]:
    """``train_step(run)`` whose divergence raises :class:`NonFiniteError` before any checkpoint of it."""
    step = run.step + 1
    try:
        metrics = train_step(run)
    except FloatingPointError as err:  # megatron-core's optimizer refused an update with inf/NaN gradients
        raise NonFiniteError(f"training diverged at step {step}: {err}; stopped before step {step}'s checkpoint "
                             "(lower agents.*.lr or train.grad_clip, then resume)") from err
    check_finite_step(step, metrics, [rt.name for rt in run.runtimes], run.exp.train.grad_clip)
    return metrics
