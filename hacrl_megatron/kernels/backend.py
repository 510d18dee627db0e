"""The protocol of a sequence log-prob kernel backend: what ``core.py`` asks of an implementation.

Two implementations: ``reference.BACKEND`` (chunked torch, every device and floating dtype) and
``triton_impl.BACKEND`` (fused Triton kernels; CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).
``core.resolve_backend`` picks one; the forward, backward and vocab-parallel bookkeeping in
``core.py`` are shared, so a backend supplies only the two primitives below and its chunking.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LogProbBackend(Protocol):
    """A kernel backend (see the module docstring).

    name: "reference" | "triton" (the ``impl`` that selects it).
    vocab_align: the backward's vocabulary slices are multiples of this many columns (1: any width).
    """

    name: str
    vocab_align: int

    def supports(self, dtype: torch.dtype) -> bool:
        """Whether the primitives run on ``dtype`` inputs (``impl="auto"`` falls back to the reference)."""

    def check_supported(self, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        """Raise a ValueError that names what to use instead when the inputs cannot run here."""

    def default_chunk_size(self, local_vocab: int) -> int:
        """The ``chunk_size`` (tokens) used when the caller gives none, for a shard of ``local_vocab`` rows."""

    def shard_stats(self, hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor,
                    temperature: float, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token (max_v z, Σ_v exp(z − max), target z or exactly 0) over this vocab shard, [N] each
        in the accumulation dtype, for z = (h·Wᵀ)/T (see ``reference.shard_stats``). A
        ``local_targets`` id outside [0, V_local) contributes exactly 0, whatever its value."""

    def grad_logits_chunk(self, hidden: torch.Tensor, weight_chunk: torch.Tensor, chunk_targets: torch.Tensor,
                          lse: torch.Tensor, grad_scale: torch.Tensor, temperature: float,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """dL/dx [N, V_c] for one vocab slice of the raw logits x = h·W_cᵀ (see
        ``reference.grad_logits_chunk``); ``out`` is a buffer to reuse."""
