"""Sequence log-probs from hidden states × LM head without materialising [N, V] logits.

    z_tv   = (h_t · W_v) / T                     over the global vocabulary (sharded under TP)
    logp_t = z_{t, y_t} − logsumexp_v z_tv       per token, float32 (float64 for float64 inputs)
    S_s    = Σ_{t ∈ s} logp_t,  L_s = |s|        per packed sequence (docs/algorithm.md §3's Σ_t log π(ỹ_t))

Forward saves only lse [N]; backward recomputes logits one vocabulary slice [N, V_c] at a time,
forms dL/dx = w_t·(onehot − softmax)/T for the upstream per-token weights w_t, and
accumulates dH (fp32) across slices while writing each slice of dW exactly once (chunking over the
vocabulary rather than tokens: dW is the larger operand, see docs/measured.md §10).

Two backends with the same primitives (:class:`~hacrl_megatron.kernels.backend.LogProbBackend`):
``reference`` (chunked torch, any device) and ``triton`` (fused Triton kernels; CUDA, or CPU
tensors under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hacrl_megatron.kernels import reference
from hacrl_megatron.kernels.backend import LogProbBackend
from hacrl_megatron.kernels.gemm import acc_dtype_for, addmm_acc_, half_gemm_on_cuda, matmul_acc
from hacrl_megatron.kernels.vocab_parallel import (
    VocabShard,
    all_reduce_grad_hidden,
    combine_shard_stats,
    vocab_shard,
)

IMPLS = ("auto", "reference", "triton")


@dataclass(frozen=True)
class SequenceLogProbs:
    """Output of :func:`sequence_logprobs` (same field names as ``agents.batch.LogProbOutput``).

    token_logps: [N] float32 (float64 for float64 inputs), log π(y_t | ·) at temperature T;
        differentiable w.r.t. ``hidden`` and ``weight``.
    seq_logp_sum: [S] same dtype, Σ of ``token_logps`` over each sequence, summed one sequence at
        a time (``torch.segment_reduce``) so that it does not depend on the other sequences.
    seq_len: [S] int64 token counts (cu_seqlens[s+1] − cu_seqlens[s]).
    """

    token_logps: torch.Tensor
    seq_logp_sum: torch.Tensor
    seq_len: torch.Tensor


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(impl: str, device: torch.device) -> LogProbBackend:
    """The backend for ``impl`` ("auto" = triton on CUDA when it imports, else reference).

    Raises a RuntimeError when ``impl="triton"`` cannot run here (no triton, or CPU tensors
    without ``TRITON_INTERPRET=1``).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: must be one of {IMPLS}")
    has_triton = importlib.util.find_spec("triton") is not None
    if impl == "auto":
        impl = "triton" if device.type == "cuda" and has_triton else "reference"
    if impl == "reference":
        return reference.BACKEND
    if not has_triton:
        raise RuntimeError("impl='triton' needs the triton package: pip install triton")
    if device.type != "cuda" and not _triton_interpret():
        raise RuntimeError(
            f"impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported to "
            f"interpret the kernels on {device.type} tensors (slow; tests only); use impl='reference'"
        )
    from hacrl_megatron.kernels import triton_impl  # lazy: triton is an optional dependency

    return triton_impl.BACKEND


def validate_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperature: float,
    chunk_size: int | None,
    shard: VocabShard,
    vocab_size: int,
) -> torch.Tensor:
    """Check shapes, dtypes, ranges; return seq_len [S] (int64, on ``hidden``'s device)."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"hidden must be [N, H] and weight [V_local, H]; got shapes "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    n, h = hidden.shape
    if weight.shape[1] != h:
        raise ValueError(f"weight has hidden size {weight.shape[1]}, hidden has {h}")
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share one floating dtype; got {hidden.dtype} and {weight.dtype}")
    if hidden.device != weight.device or targets.device != hidden.device:
        raise ValueError(f"hidden, weight and targets must be on one device; got {hidden.device}, "
                         f"{weight.device}, {targets.device}")
    if targets.shape != (n,) or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be [N={n}] int32/int64, got shape {tuple(targets.shape)} {targets.dtype}")
    if n == 0 or weight.shape[0] == 0:
        raise ValueError(f"need at least one token and one vocab row; got N={n}, V_local={weight.shape[0]}")
    lo, hi = int(targets.min()), int(targets.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"targets must lie in [0, vocab_size={vocab_size}) (V_local={shard.size} × tp={shard.world});"
                         f" got min {lo}, max {hi}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be an integer [S+1] tensor with S >= 1, got "
                         f"shape {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    seq_len = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != n:
        raise ValueError(f"cu_seqlens must start at 0 and end at N={n}; got {int(cu[0])} … {int(cu[-1])}")
    if bool((seq_len <= 0).any()):
        bad = int(torch.nonzero(seq_len <= 0)[0, 0])
        raise ValueError(f"cu_seqlens must be strictly increasing (every sequence >= 1 token); "
                         f"cu_seqlens[{bad}]={int(cu[bad])} >= cu_seqlens[{bad + 1}]={int(cu[bad + 1])}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature={temperature}: must be a finite number > 0")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r}: must be a positive int (tokens per chunk) or None")
    return seq_len.to(hidden.device)


OFF_SHARD = -1  # local target id of a token whose target lives on another rank (or in no real row)


def local_target_ids(targets: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """[N] int64 ids into this rank's real rows [0, shard.valid); ``OFF_SHARD`` for every other id.

    Mapping before the launch keeps a kernel from reading another rank's id as one of its own
    columns: an id in [valid, next block) would otherwise index the unused columns of the last,
    partly empty vocab block (−inf logits) whenever V_local is not a multiple of the block.
    """
    local = targets.to(torch.int64) - shard.start
    mine = (local >= 0) & (local < shard.valid)
    return torch.where(mine, local, torch.full_like(local, OFF_SHARD))


def forward_lse_logp(backend: LogProbBackend, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     temperature: float, chunk_size: int, group: dist.ProcessGroup | None,
                     shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse [N], token log-probs [N]) over the global vocabulary, both in the accumulation dtype."""
    local_targets = local_target_ids(targets, shard)
    if shard.valid > 0:  # padding rows (ids >= vocab_size) are cut off before any logit is formed
        shard_max, shard_sum, shard_tgt = backend.shard_stats(
            hidden, weight[:shard.valid], local_targets, temperature, chunk_size)
    else:  # a rank holding only padding: the identities of max, sum and target logit
        shard_max = torch.full(targets.shape, float("-inf"), dtype=acc_dtype_for(hidden.dtype),
                               device=hidden.device)
        shard_sum, shard_tgt = torch.zeros_like(shard_max), torch.zeros_like(shard_max)
    lse, target_logit = combine_shard_stats(shard_max, shard_sum, shard_tgt, group)
    return lse, target_logit - lse


def backward_hidden_weight(backend: LogProbBackend, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           lse: torch.Tensor, grad_logp: torch.Tensor, temperature: float, chunk_size: int,
                           group: dist.ProcessGroup | None, shard: VocabShard,
                           need_hidden: bool = True,
                           need_weight: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dH [N, H], dW [V_local, H]) in the input dtype for upstream per-token gradients ``grad_logp``.

    Loops over vocabulary slices of V_c ≈ chunk_size·V_local/N columns (a multiple of the backend's
    ``vocab_align``): dH accumulates in fp32 across slices and is all-reduced over ``group`` at
    the end (the only backward collective); each dW slice is one GEMM over all N tokens.
    """
    n, _ = hidden.shape
    vocab = shard.valid  # padding rows get a zero gradient
    acc = lse.dtype
    align = backend.vocab_align
    width = max(1, min(vocab, max(align, -(-chunk_size * vocab // n) // align * align)))
    grad_scale = grad_logp.to(acc) / temperature
    local_targets = local_target_ids(targets, shard)  # OFF_SHARD − start stays negative: no column
    # GEMM operands: half inputs stay half on CUDA (tensor cores, fp32 output); else upcast once
    gemm_dtype = hidden.dtype if half_gemm_on_cuda(hidden) else acc
    hidden_g = hidden.to(gemm_dtype)
    grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_hidden else None
    grad_weight = None
    if need_weight:
        grad_weight = torch.empty_like(weight)
        grad_weight[vocab:].zero_()
    dlogits = None  # one [N, V_c] buffer, reused by every slice
    for start in range(0, vocab, width):
        stop = min(start + width, vocab)
        w_chunk = weight[start:stop]
        dlogits = backend.grad_logits_chunk(hidden, w_chunk, local_targets - start, lse, grad_scale, temperature,
                                            out=dlogits)
        gemm_in = dlogits.to(gemm_dtype)  # a copy only for the reference's fp32 slice on CUDA half
        if grad_hidden is not None:
            addmm_acc_(grad_hidden, gemm_in, w_chunk.to(gemm_dtype))
        if grad_weight is not None and gemm_dtype == weight.dtype:  # one rounding, straight into dW
            torch.mm(gemm_in.t(), hidden_g, out=grad_weight[start:stop])
        elif grad_weight is not None:
            grad_weight[start:stop] = matmul_acc(gemm_in.t(), hidden_g, acc)
    if grad_hidden is None:
        return None, grad_weight
    return all_reduce_grad_hidden(grad_hidden, group).to(hidden.dtype), grad_weight


@dataclass(frozen=True)
class KernelOptions:
    """Everything but the tensors: fixed for one call (held by the autograd Functions)."""

    backend: LogProbBackend
    temperature: float
    chunk_size: int
    group: dist.ProcessGroup | None
    shard: VocabShard


def prepare(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, cu_seqlens: torch.Tensor,
            temperature: float, tp_group: dist.ProcessGroup | None, impl: str,
            chunk_size: int | None, vocab_size: int | None = None) -> tuple[KernelOptions, torch.Tensor]:
    """Validate the inputs and pick the backend; returns (options, seq_len [S])."""
    backend = resolve_backend(impl, hidden.device)
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V_local, H], got shape {tuple(weight.shape)}")
    shard = vocab_shard(weight.shape[0], tp_group, vocab_size)
    real_vocab = shard.global_size if vocab_size is None else vocab_size
    seq_len = validate_inputs(hidden, weight, targets, cu_seqlens, temperature, chunk_size, shard, real_vocab)
    if impl == "auto" and not backend.supports(hidden.dtype):
        backend = reference.BACKEND  # auto: float64 goes to the reference instead of failing
    backend.check_supported(hidden, weight)  # an explicit impl="triton" rejects float64 with advice
    if chunk_size is None:
        chunk_size = backend.default_chunk_size(weight.shape[0])
    return KernelOptions(backend, float(temperature), chunk_size, tp_group, shard), seq_len


class _TokenLogProbs(torch.autograd.Function):
    """token log-probs [N] = f(hidden, weight); backward is one weighted vocab pass."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, opts: KernelOptions):  # type: ignore[override]
        lse, logp = forward_lse_logp(opts.backend, hidden, weight, targets, opts.temperature,
                                     opts.chunk_size, opts.group, opts.shard)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.opts = opts
        return logp

    @staticmethod
    def backward(ctx, grad_logp):  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        opts: KernelOptions = ctx.opts
        grad_hidden, grad_weight = backward_hidden_weight(
            opts.backend, hidden, weight, targets, lse, grad_logp, opts.temperature, opts.chunk_size,
            opts.group, opts.shard, need_hidden=ctx.needs_input_grad[0], need_weight=ctx.needs_input_grad[1])
        return grad_hidden, grad_weight, None, None


def segment_sums(token_logps: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
    """Σ over each sequence's tokens, [S]; one sequence at a time, so batch-invariant."""
    return torch.segment_reduce(token_logps, "sum", lengths=seq_len)


def sequence_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    impl: str = "auto",
    chunk_size: int | None = None,
    vocab_size: int | None = None,
) -> SequenceLogProbs:
    """Per-token and per-sequence log-probs of ``targets`` under logits (hidden·weightᵀ)/T.

    Args:
        hidden: [N, H] final hidden states of N packed tokens (float16/bfloat16/float32/float64),
            row t predicting ``targets[t]``.
        weight: [V_local, H] this rank's LM-head shard (rows [r·V_local, (r+1)·V_local) of the vocab).
        targets: [N] int global vocab ids.
        cu_seqlens: [S+1] int offsets of the S sequences in the packed tokens: 0 = c_0 < … < c_S = N.
        temperature: T > 0, the sampling temperature (log-probs of softmax(logits/T)).
        tp_group: tensor-parallel group sharding the vocabulary, or None (unsharded). With a group
            the backward all-reduces dH across it (see ``vocab_parallel.py``).
        impl: "reference" (chunked torch), "triton" (fused kernels), or "auto" (triton on CUDA).
        chunk_size: tokens per logits chunk, fixed for a run (batch invariance holds for one value).
            The reference's forward pads N up to whole [chunk_size, V_local] tiles; both backends'
            backward takes vocab slices [N, ≈chunk_size·V_local/N]. None picks the backend's
            ``default_chunk_size(V_local)``: about 2**24 logits (at most 512 tokens) per chunk for the
            reference, 2**27 dlogits for Triton. Extra memory is O(N + chunk_size·V_local) besides
            the fp32 dH accumulator [N, H].
        vocab_size: the real global vocabulary when ``weight`` carries Megatron's padding rows
            (ids >= vocab_size get no probability and a zero gradient); default: all rows are real.

    Returns:
        :class:`SequenceLogProbs`; accumulation and outputs in float32 (float64 for float64 inputs),
        gradients returned in the input dtype. The forward is deterministic and batch-invariant
        (a sequence's values do not change with the rest of the batch) for a fixed chunk_size.
    """
    opts, seq_len = prepare(hidden, weight, targets, cu_seqlens, temperature, tp_group, impl, chunk_size,
                            vocab_size)
    token_logps = _TokenLogProbs.apply(hidden, weight, targets, opts)
    return SequenceLogProbs(token_logps, segment_sums(token_logps, seq_len), seq_len)
