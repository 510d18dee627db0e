"""Chunked pure-torch backend of the sequence log-prob kernel (runs on every device).

Two primitives, shared in shape with the Triton backend (``triton_impl.py``):

* :func:`shard_stats` — per-token (max, Σexp, target logit) over this rank's vocab shard, computed
  over fixed-shape row tiles of ``chunk_size`` tokens × the whole shard. The last tile is
  zero-padded to the full tile so that every GEMM and every row reduction has the same shape
  whatever N is: BLAS and torch reductions may pick a different accumulation order for a
  different shape, and a sequence's log-prob must not depend on what else is in the batch.
* :func:`grad_logits_chunk` — dL/dx for one vocabulary slice [N, V_c] of the raw logits x = h·Wᵀ,
  recomputed from the saved log-sum-exp: w_t·(onehot_t − softmax_t)/T.

Memory: one [chunk_size, V_local] tile in the forward, one [N, V_c] slice in the backward (V_c is
chosen in ``core.py`` so that N·V_c ≈ chunk_size·V_local), plus O(N) vectors.
"""

from __future__ import annotations

import torch

from hacrl_megatron.kernels.gemm import acc_dtype_for, half_gemm_on_cuda, matmul_acc, workspace

# Elements of one logits chunk when the caller does not choose: 2**24 fp32 values = 64 MiB.
DEFAULT_CHUNK_ELEMENTS = 1 << 24


MAX_DEFAULT_TILE_ROWS = 512


def default_chunk_size(local_vocab: int) -> int:
    """Tokens per forward tile: about 2**24 logits per tile, a multiple of 16 in [16, 512].

    The cap bounds the padding work when N is small (every tile is padded to the full size, see
    :func:`shard_stats`); 512 rows keep CPU GEMMs efficient (MKL re-packs W on every call).
    """
    rows = (DEFAULT_CHUNK_ELEMENTS // max(local_vocab, 1)) // 16 * 16
    return min(MAX_DEFAULT_TILE_ROWS, max(16, rows))


def shard_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    local_targets: torch.Tensor,
    temperature: float,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token statistics of the logits z = (h·Wᵀ)/T over this vocab shard.

    Args:
        hidden: [N, H]; weight: [V_local, H]; local_targets: [N] int64, target id minus the
            shard's first id; any id outside [0, V_local) (``core.local_target_ids`` passes −1)
            means the target lives on another rank.
        temperature: T > 0; chunk_size: rows per (zero-padded) tile.

    Returns three [N] tensors in the accumulation dtype: max_v z, Σ_v exp(z − max), and z of
    the target (exactly 0 when it is not in this shard).
    """
    n, h = hidden.shape
    vocab = weight.shape[0]
    acc = acc_dtype_for(hidden.dtype)
    # upcast the shard once when half GEMMs cannot write fp32 here (CPU), not once per tile
    w_t = weight.t() if weight.dtype == acc or half_gemm_on_cuda(weight) else weight.to(acc).t()
    in_shard = (local_targets >= 0) & (local_targets < vocab)
    gather_idx = local_targets.clamp(0, vocab - 1)
    out_max = torch.empty(n, dtype=acc, device=hidden.device)
    out_sum = torch.empty_like(out_max)
    out_tgt = torch.empty_like(out_max)
    tile = None
    z = torch.empty(chunk_size, vocab, dtype=acc, device=hidden.device)  # the one logits tile
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        count = stop - start
        rows = hidden[start:stop]
        if count < chunk_size:  # pad the last tile: same GEMM shape for every tile
            tile = hidden.new_zeros(chunk_size, h) if tile is None else tile.zero_()
            tile[:count] = rows
            rows = tile
        matmul_acc(rows, w_t, acc, out=z)  # [chunk_size, V_local]
        if temperature != 1.0:
            z.div_(temperature)
        tgt = z[:count].gather(1, gather_idx[start:stop, None])[:, 0]
        out_tgt[start:stop] = torch.where(in_shard[start:stop], tgt, torch.zeros_like(tgt))
        z_max = z.amax(dim=1)
        out_max[start:stop] = z_max[:count]
        out_sum[start:stop] = z.sub_(z_max[:, None]).exp_().sum(dim=1)[:count]
    return out_max, out_sum, out_tgt


def grad_logits_chunk(
    hidden: torch.Tensor,
    weight_chunk: torch.Tensor,
    chunk_targets: torch.Tensor,
    lse: torch.Tensor,
    grad_scale: torch.Tensor,
    temperature: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dL/dx [N, V_c] for one vocab slice of the raw logits x = h·W_cᵀ (accumulation dtype).

    With z = x/T, p = softmax(z) over the global vocab (via the saved ``lse``) and upstream
    gradient w_t = dL/dlogp_t: dL/dx_tv = (w_t/T)·(1[v = y_t] − p_tv). ``grad_scale`` is w/T [N];
    ``chunk_targets`` is y_t minus the slice's first global id. ``out``: a buffer to reuse (the
    previous slice's result), see :func:`workspace`.
    """
    acc = lse.dtype
    width = weight_chunk.shape[0]
    z = matmul_acc(hidden, weight_chunk.t(), acc, out=workspace(out, (hidden.shape[0], width), acc, hidden.device))
    if temperature != 1.0:
        z.div_(temperature)
    grad = z.sub_(lse[:, None]).exp_().mul_(-grad_scale[:, None])  # −(w/T)·p, in place
    in_chunk = (chunk_targets >= 0) & (chunk_targets < width)
    onehot = torch.where(in_chunk, grad_scale, torch.zeros_like(grad_scale))
    # one entry per row at most: a scatter-add without duplicate indices is deterministic
    grad.scatter_add_(1, chunk_targets.clamp(0, width - 1)[:, None], onehot[:, None])
    return grad


class ReferenceBackend:
    """The chunked-torch :class:`~hacrl_megatron.kernels.backend.LogProbBackend` (any device, any float dtype)."""

    name = "reference"
    vocab_align = 1

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def check_supported(self, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        """Every input that passes ``core.validate_inputs`` runs here."""

    default_chunk_size = staticmethod(default_chunk_size)
    shard_stats = staticmethod(shard_stats)
    grad_logits_chunk = staticmethod(grad_logits_chunk)


BACKEND = ReferenceBackend()
