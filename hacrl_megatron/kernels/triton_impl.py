"""Triton backend of the sequence log-prob kernel (imported lazily by ``core.resolve_backend``).

Forward — ``_shard_stats_kernel``: program (i, j) owns BLOCK_M tokens × vocabulary split j
(SPLIT_V columns). It walks the split's BLOCK_V-wide blocks in order, computing each logits tile
with ``tl.dot`` over BLOCK_K slices of H (fp32 accumulator) and folding it into an online
log-sum-exp (running max, with −inf as the identity and for padded columns) and the target logit.
Each split writes (max, Σexp, target) per token; ``_merge_splits`` folds the splits in a fixed order.
No atomics, and the tile configuration depends only on the device and dtype — never on N — so a
token's result is bitwise the same whatever else is in the batch (so old and new log-probs give a
ratio of exactly 1 when the weights are equal).

Backward — ``_grad_logits_kernel`` recomputes one vocabulary slice of logits tile by tile (the same
``tl.dot`` sequence as the forward) and writes dL/dx = (w_t/T)·(onehot − exp(z − lse)) straight in
the GEMM dtype; ``core.backward_hidden_weight`` then runs the two GEMMs per slice with cuBLAS
(dH += dX·W_c into an fp32 accumulator, dW_c = dXᵀ·H written once), as verl's default mode does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hacrl_megatron.kernels.gemm import acc_dtype_for, workspace

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


CONFIG_KEYS = ("BLOCK_M", "BLOCK_V", "BLOCK_K", "SPLIT_V", "num_warps", "num_stages")
# Tuning knob for GPU sessions (benchmarks/bench_logprobs.py --configs): six comma-separated ints
# in CONFIG_KEYS order. Read per call; keep it fixed within a run, or old and new log-probs differ.
CONFIG_ENV = "HACRL_LOGPROB_TRITON_CONFIG"


# CUDA tiles: 128×128 logits tiles with a 64-wide K step for half inputs (wgmma; 254 registers per
# thread for the forward on sm_90, no spills). fp32 inputs multiply on the FMA units (IEEE, no tf32),
# whose 128×128 tile needs more than the 255 registers a thread has: ptxas spills 216 B per thread
# (592 B when H % 64 != 0); 128×64 tiles use 212 and do not spill (benchmarks/RESULTS_kernels.md).
CUDA_CONFIG = {"BLOCK_M": 128, "BLOCK_V": 128, "BLOCK_K": 64, "SPLIT_V": 8192, "num_warps": 8, "num_stages": 3}
CUDA_CONFIG_FP32 = {**CUDA_CONFIG, "BLOCK_V": 64}


def _config(device: torch.device, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Tile sizes: large on CUDA (GEMM-efficient; per input dtype), tiny under the CPU interpreter
    (fast tests). ``dtype`` None: the half-precision tiles.

    Fixed per device kind and dtype — choosing them from N would break batch invariance.
    """
    if device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_V": 32, "BLOCK_K": 16, "SPLIT_V": 128, "num_warps": 4, "num_stages": 1}
    override = os.environ.get(CONFIG_ENV)
    if override:
        values = [int(x) for x in override.split(",")]
        if len(values) != len(CONFIG_KEYS) or values[3] % values[1] or 128 % values[1]:
            raise ValueError(f"{CONFIG_ENV}={override!r}: need {len(CONFIG_KEYS)} ints {CONFIG_KEYS}, with "
                             f"SPLIT_V a multiple of BLOCK_V and BLOCK_V dividing 128")
        return dict(zip(CONFIG_KEYS, values))
    return dict(CUDA_CONFIG_FP32 if dtype == torch.float32 else CUDA_CONFIG)


# The backward's vocab slices are multiples of this (of every CUDA BLOCK_V; also a multiple of 32).
VOCAB_ALIGN = 128
# Elements of one [N, V_c] dlogits slice by default: 2**27 half values = 256 MiB.
DEFAULT_CHUNK_ELEMENTS = 1 << 27


def default_chunk_size(local_vocab: int) -> int:
    """Tokens' worth of logits per backward slice: about 2**27 elements (the forward needs none)."""
    return max(16, DEFAULT_CHUNK_ELEMENTS // max(local_vocab, 1))


def check_supported(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """Reject inputs the kernels do not handle, saying what to use instead."""
    if hidden.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"impl='triton' supports {SUPPORTED_DTYPES}, got {hidden.dtype}; use impl='reference'")


def _dot_options(t: torch.Tensor) -> dict[str, object]:
    """tl.dot settings: IEEE fp32 for fp32 inputs (GPUs would otherwise round them to tf32); under
    the CPU interpreter bf16 operands are upcast first, because its numpy ``tl.dot`` multiplies the
    raw uint16 bit patterns it stores bf16 in (exact either way: bf16 products fit in fp32)."""
    upcast = t.dtype == torch.bfloat16 and not t.is_cuda
    return {"PRECISION": "ieee" if t.dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast}


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, cols, row_mask, col_mask, K, stride_hn, stride_wv,
                 BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr):
    """[BLOCK_M, BLOCK_V] fp32 tile of h·Wᵀ, K reduced in BLOCK_K steps in a fixed order."""
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_hn
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wv
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        if EVEN_K:  # K % BLOCK_K == 0: only rows/columns need masks
            h = tl.load(h_rows + kk[None, :], mask=row_mask[:, None], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=col_mask[:, None], other=0.0)
        else:
            k_mask = kk < K
            h = tl.load(h_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _shard_stats_kernel(h_ptr, w_ptr, tgt_ptr, max_ptr, sum_ptr, tl_ptr, N, V, K, split_v, temperature,
                        stride_hn, stride_wv,
                        BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
    v_lo = pid_s * split_v
    v_hi = tl.minimum(v_lo + split_v, V)
    run_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    tgt_logit = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_hi
        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_mask, col_mask, K, stride_hn, stride_wv,
                         BLOCK_M, BLOCK_V, BLOCK_K, PRECISION, UPCAST, EVEN_K) / temperature
        z = tl.where(col_mask[None, :], z, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(z, axis=1))  # finite: every block has a valid column
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(z - new_max[:, None]), axis=1)
        # only ~BLOCK_M/n_blocks of the blocks hold some row's target: skip the select elsewhere
        # (the skipped terms are exact zeros, so the result does not depend on the skipping).
        # The select is masked to this split's real columns: a target id past v_hi (another
        # rank's, or the next split's) must not pick the −inf of the last block's empty columns.
        hits = ((tgt >= v0) & (tgt < tl.minimum(v0 + BLOCK_V, v_hi))).to(tl.int32)
        if tl.max(hits, axis=0) > 0:
            is_tgt = (cols[None, :] == tgt[:, None]) & col_mask[None, :]
            tgt_logit += tl.sum(tl.where(is_tgt, z, 0.0), axis=1)
        run_max = new_max
    out = pid_s * N + rows
    tl.store(max_ptr + out, run_max, mask=row_mask)
    tl.store(sum_ptr + out, run_sum, mask=row_mask)
    tl.store(tl_ptr + out, tgt_logit, mask=row_mask)


@triton.jit
def _grad_logits_kernel(h_ptr, w_ptr, tgt_ptr, lse_ptr, scale_ptr, d_ptr, N, V, K, temperature,
                        stride_hn, stride_wv, stride_dn,
                        BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < N
    col_mask = cols < V
    z = _logits_tile(h_ptr, w_ptr, rows, cols, row_mask, col_mask, K, stride_hn, stride_wv,
                     BLOCK_M, BLOCK_V, BLOCK_K, PRECISION, UPCAST, EVEN_K) / temperature
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
    onehot = tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0)
    grad = scale[:, None] * (onehot - tl.exp(z - lse[:, None]))
    ptrs = d_ptr + rows.to(tl.int64)[:, None] * stride_dn + cols[None, :]
    tl.store(ptrs, grad.to(d_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _merge_splits(part_max: torch.Tensor, part_sum: torch.Tensor,
                  part_tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold [splits, N] partial statistics in split order (a fixed, N-independent order)."""
    shard_max = part_max.amax(dim=0)  # max is exact in any order
    shard_sum = torch.zeros_like(shard_max)
    shard_tgt = torch.zeros_like(shard_max)
    for j in range(part_max.shape[0]):
        shard_sum += part_sum[j] * torch.exp(part_max[j] - shard_max)
        shard_tgt += part_tgt[j]  # at most one split holds the target; the rest add exact zeros
    return shard_max, shard_sum, shard_tgt


def shard_stats(hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor,
                temperature: float, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.shard_stats``; ``chunk_size`` is unused (no logits are stored)."""
    del chunk_size
    hidden, weight = _contiguous_rows(hidden), _contiguous_rows(weight)
    n, k = hidden.shape
    vocab = weight.shape[0]
    cfg = _config(hidden.device, hidden.dtype)
    split_v = cfg["SPLIT_V"]
    splits = triton.cdiv(vocab, split_v)
    parts = torch.empty(3, splits, n, dtype=torch.float32, device=hidden.device)
    grid = (triton.cdiv(n, cfg["BLOCK_M"]), splits)
    _shard_stats_kernel[grid](
        hidden, weight, local_targets.contiguous(), parts[0], parts[1], parts[2], n, vocab, k, split_v,
        float(temperature), hidden.stride(0), weight.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_V=cfg["BLOCK_V"], BLOCK_K=cfg["BLOCK_K"],
        EVEN_K=k % cfg["BLOCK_K"] == 0, **_dot_options(hidden),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return _merge_splits(parts[0], parts[1], parts[2])


def grad_logits_chunk(hidden: torch.Tensor, weight_chunk: torch.Tensor, chunk_targets: torch.Tensor,
                      lse: torch.Tensor, grad_scale: torch.Tensor, temperature: float,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``reference.grad_logits_chunk``; returns [N, V_c] in the GEMM dtype
    (the input dtype for half inputs on CUDA, float32 otherwise)."""
    hidden, weight_chunk = _contiguous_rows(hidden), _contiguous_rows(weight_chunk)
    n, k = hidden.shape
    width = weight_chunk.shape[0]
    cfg = _config(hidden.device, hidden.dtype)
    out_dtype = hidden.dtype if hidden.is_cuda else acc_dtype_for(hidden.dtype)
    dlogits = workspace(out, (n, width), out_dtype, hidden.device)
    grid = (triton.cdiv(n, cfg["BLOCK_M"]), triton.cdiv(width, cfg["BLOCK_V"]))
    _grad_logits_kernel[grid](
        hidden, weight_chunk, chunk_targets.contiguous(), lse.contiguous(), grad_scale.contiguous(), dlogits,
        n, width, k, float(temperature), hidden.stride(0), weight_chunk.stride(0), dlogits.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_V=cfg["BLOCK_V"], BLOCK_K=cfg["BLOCK_K"],
        EVEN_K=k % cfg["BLOCK_K"] == 0, **_dot_options(hidden),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return dlogits


class TritonBackend:
    """The fused-Triton :class:`~hacrl_megatron.kernels.backend.LogProbBackend` (half and fp32 inputs)."""

    name = "triton"
    vocab_align = VOCAB_ALIGN

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in SUPPORTED_DTYPES

    check_supported = staticmethod(check_supported)
    default_chunk_size = staticmethod(default_chunk_size)
    shard_stats = staticmethod(shard_stats)
    grad_logits_chunk = staticmethod(grad_logits_chunk)


BACKEND = TritonBackend()
