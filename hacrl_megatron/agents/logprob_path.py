"""Which way the last pipeline stage computes response log-probs: the one rule for trainer and planner.

Two paths (docs/architecture.md, "Log-probs on the last stage"):

* ``fused`` (``logprob_impl`` "auto" | "reference" | "triton"): the model returns its final hidden
  states, the N scored rows are taken out and ``hacrl_megatron.kernels.sequence_logprobs`` computes
  the log-probs from hidden × the rank's vocabulary shard of the LM head, chunk by chunk; no
  [N, V] logits ever exist. Under sequence parallelism each TP rank holds only a slice of the
  sequence, so the scored rows are first all-gathered over the TP group (``gather_rows``).
* ``megatron`` (``logprob_impl="megatron"``): megatron's output layer materialises the vocab-parallel
  logits [B, T, V_pad/tp] and ``vocab_parallel_cross_entropy`` scores them.

:func:`logprob_path` is called by ``agents.lm_head.build_lm_head`` (what the trainer runs) and by
``plan.memory.trainer_memory`` (what the planner counts), so the two cannot disagree. This module
imports nothing heavy: the planner runs without torch's distributed machinery.
"""

from __future__ import annotations

from dataclasses import dataclass

LOGPROB_IMPLS = ("auto", "reference", "triton", "megatron")
KERNEL_IMPLS = ("auto", "reference", "triton")  # the fused kernel's backends (hacrl_megatron.kernels.IMPLS)


@dataclass(frozen=True)
class LogProbPath:
    """How the last stage turns its output into log-probs.

    name: "fused" (our kernel on hidden states) | "megatron" (materialised logits).
    kernel_impl: the kernel backend for ``fused`` ("auto" | "reference" | "triton"); None for megatron.
    gather_rows: ``fused`` under sequence parallelism: the scored rows' hidden states [N, H] are
        all-gathered over the TP group before the kernel (each rank holds [T/tp, B, H] of the sequence).
    """

    name: str
    kernel_impl: str | None
    gather_rows: bool

    @property
    def materialises_logits(self) -> bool:
        """True when [N, V_pad/tp] logits (and their softmax) are held on the last stage."""
        return self.name == "megatron"


def logprob_path(impl: str, sequence_parallel: bool) -> LogProbPath:
    """The path for ``impl`` (one of :data:`LOGPROB_IMPLS`) at this sequence-parallel setting.

    ``sequence_parallel`` is the effective setting (requested and tp > 1). Every kernel impl stays
    fused under sequence parallelism: only the explicit "megatron" materialises logits.
    """
    if impl not in LOGPROB_IMPLS:
        raise ValueError(f"logprob_impl={impl!r}: must be one of {list(LOGPROB_IMPLS)}")
    if impl == "megatron":
        return LogProbPath("megatron", None, gather_rows=False)
    return LogProbPath("fused", impl, gather_rows=bool(sequence_parallel))
