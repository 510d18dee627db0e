"""The HACPO step fused onto the sequence log-prob kernel (docs/algorithm.md §3-5, §7).

Forward: kernel → per-token log-probs → per-sequence sums S_s (batch-invariant) → the pure algo
function on [S] vectors (``algo.hacpo_loss``) → loss and metrics.
Still inside the forward, autograd over that tiny [S] graph gives g_s = dLoss/dS_s. Because
S_s = Σ_{t∈s} logp_t, the loss gradient w.r.t. every token log-prob of sequence s is the same
scalar, w_t = g_s (e.g. −ω·s_c^(α+1)·A/(L_k·num_sequences) for an in-window cross sequence).
Backward: a single weighted softmax-minus-one-hot pass over the vocabulary,
dL/dx_tv = upstream·(w_t/T)·(1[v = y_t] − p_tv), the same pass as ``sequence_logprobs``' backward.
No [N, V] tensor and no per-token graph is ever built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from hacrl_megatron.algo import LossInputs, hacpo_loss
from hacrl_megatron.config import HACPOConfig
from hacrl_megatron.kernels.core import (
    KernelOptions,
    backward_hidden_weight,
    forward_lse_logp,
    prepare,
    segment_sums,
)

SequenceLossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


class _FusedSequenceLoss(torch.autograd.Function):
    """loss = loss_fn(per-sequence log-prob sums); d loss/d(hidden, weight) in one vocab pass."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, seq_len, loss_fn: SequenceLossFn, opts: KernelOptions,
                metrics_out: dict):  # type: ignore[override]
        lse, token_logps = forward_lse_logp(opts.backend, hidden, weight, targets, opts.temperature,
                                            opts.chunk_size, opts.group, opts.shard)
        seq_sums = segment_sums(token_logps, seq_len)
        with torch.enable_grad():  # Function.forward runs under no_grad; the [S] graph needs grad
            leaf = seq_sums.detach().requires_grad_(True)
            loss, metrics = loss_fn(leaf)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}")
            (grad_seq,) = torch.autograd.grad(loss, leaf, allow_unused=True)
        if grad_seq is None:  # the loss does not depend on the log-probs (e.g. no sequences trained)
            grad_seq = torch.zeros_like(seq_sums)
        metrics_out.update(metrics)
        token_weight = torch.repeat_interleave(grad_seq, seq_len)  # w_t = dLoss/dlogp_t, [N]
        ctx.save_for_backward(hidden, weight, targets, lse, token_weight)
        ctx.opts = opts
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        hidden, weight, targets, lse, token_weight = ctx.saved_tensors
        opts: KernelOptions = ctx.opts
        grad_hidden, grad_weight = backward_hidden_weight(
            opts.backend, hidden, weight, targets, lse, token_weight * grad_loss, opts.temperature,
            opts.chunk_size, opts.group, opts.shard,
            need_hidden=ctx.needs_input_grad[0], need_weight=ctx.needs_input_grad[1])
        return grad_hidden, grad_weight, None, None, None, None, None


def fused_sequence_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    cu_seqlens: torch.Tensor,
    loss_fn: SequenceLossFn,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    impl: str = "auto",
    chunk_size: int | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Any loss of the per-sequence log-prob sums, fused onto the kernel.

    ``loss_fn(seq_logp_sum [S]) -> (scalar loss, metrics)`` must be differentiable in its input;
    it runs once in the forward (with grad enabled over [S] only). Other arguments as
    :func:`~hacrl_megatron.kernels.sequence_logprobs`. Returns (loss scalar, metrics).
    """
    opts, seq_len = prepare(hidden, weight, targets, cu_seqlens, temperature, tp_group, impl, chunk_size,
                            vocab_size)
    return _apply(hidden, weight, targets, seq_len, loss_fn, opts)


def _apply(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, seq_len: torch.Tensor,
           loss_fn: SequenceLossFn, opts: KernelOptions) -> tuple[torch.Tensor, dict[str, float]]:
    metrics: dict[str, float] = {}
    loss = _FusedSequenceLoss.apply(hidden, weight, targets, seq_len, loss_fn, opts, metrics)
    return loss, metrics


def fused_hacpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    inputs: LossInputs,
    update_index: int,
    cfg: HACPOConfig,
    num_sequences: int | None = None,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    impl: str = "auto",
    chunk_size: int | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """HACPO loss of S packed sequences straight from hidden states (equals ``algo.hacpo_loss``).

    Args:
        hidden, weight, targets, cu_seqlens, temperature, tp_group, impl, chunk_size, vocab_size: as
            :func:`~hacrl_megatron.kernels.sequence_logprobs` (the learner's response tokens).
        inputs: the S sequences' :class:`~hacrl_megatron.algo.LossInputs` (advantages A^(k), is_self,
            discrepancy ω^(j,k), source Σ log π^(j)_old and L_j).
        update_index: m, the learner's mini-batch update index (eq. 14).
        cfg: algorithm switches; any sequence-level algorithm of ``algo.hacpo`` (not "grpo").
        num_sequences: the global mini-batch sequence count (docs/algorithm.md §7); default S.

    Returns:
        (loss = −Σ_s J_s / num_sequences as a differentiable scalar, metrics of ``algo.hacpo_loss``).
        log s uses L_k = the sequence's token count from ``cu_seqlens`` (eq. 11).
    """
    opts, seq_len = prepare(hidden, weight, targets, cu_seqlens, temperature, tp_group, impl, chunk_size,
                            vocab_size)
    if len(inputs) != seq_len.numel():
        raise ValueError(f"inputs hold {len(inputs)} sequences, expected S={seq_len.numel()} (one per sequence "
                         f"of cu_seqlens)")
    on_device = inputs.to(seq_len.device)

    def loss_fn(seq_logp_sum: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return hacpo_loss(seq_logp_sum, seq_len, on_device, update_index, cfg, num_sequences)

    return _apply(hidden, weight, targets, seq_len, loss_fn, opts)
