"""Sequence log-probs from hidden states × LM head without [N, V] logits, and the fused HACPO loss.

Public API::

    sequence_logprobs(hidden, weight, targets, cu_seqlens, *, temperature=1.0, tp_group=None,
                      impl="auto", chunk_size=None) -> SequenceLogProbs
    fused_hacpo_loss(hidden, weight, targets, cu_seqlens, *, inputs, update_index, cfg,
                     num_sequences=None, temperature=1.0, tp_group=None, impl="auto",
                     chunk_size=None) -> (loss, metrics)
    fused_sequence_loss(hidden, weight, targets, cu_seqlens, loss_fn, *, ...) -> (loss, metrics)

Backends: ``impl="reference"`` (chunked torch, everywhere), ``"triton"`` (fused kernels on CUDA, or
CPU tensors under ``TRITON_INTERPRET=1``), ``"auto"`` (triton on CUDA when it imports). Triton is
imported lazily, only when its backend is chosen.
"""

from hacrl_megatron.kernels.core import IMPLS, SequenceLogProbs, resolve_backend, sequence_logprobs
from hacrl_megatron.kernels.hacpo import fused_hacpo_loss, fused_sequence_loss

__all__ = [
    "IMPLS",
    "SequenceLogProbs",
    "fused_hacpo_loss",
    "fused_sequence_loss",
    "resolve_backend",
    "sequence_logprobs",
]
