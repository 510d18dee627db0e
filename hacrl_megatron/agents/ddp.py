"""megatron-core's data-parallel wrapper as an agent's layout asks for it: gradient buckets, the
overlapped gradient reduction and the overlapped parameter all-gather.

``parallel.overlap_grad_reduce``: each bucket of gradients is all-reduced (reduce-scattered with the
distributed optimizer) as soon as the last micro-batch's backward has produced all of its
gradients, while the backward of the earlier layers goes on, instead of once after the whole
backward. The schedule marks every micro-batch but the last with ``no_sync`` (megatron's
``config.no_sync_func``), so a bucket is reduced once per update, with all micro-batches' gradients
in it; ``finalize_model_grads`` waits for the last bucket.

``parallel.overlap_param_gather`` (distributed optimizer only): the optimizer step updates each
rank's shard and does not all-gather the full parameters; the next forward gathers them bucket by
bucket, each bucket just before the layers that use it (megatron's forward pre-hooks). Between the
M updates of a step this overlaps the gather with the next mini-batch's forward. After the last
update nothing forward-only may come first (the weight sync to the engines, a checkpoint, the HF
export read the parameters directly), so :func:`gather_updated_params` completes the gather at the
end of every ``train`` call.

``parallel.ddp_bucket_mb``: MiB of gradients per bucket. Gradients are reduced in fp32
(``grad_reduce_in_fp32``), so a bucket holds ``MiB · 2^20 / 4`` parameters; 0 keeps megatron's
default (max(40M, 1M · dp) parameters). Smaller buckets start the first reduction earlier and
overlap more of the backward, at the price of more, smaller collectives.

Summing two ranks' gradients is exact and independent of how the buffer is cut into buckets, so
at DP = 2 the overlapped path is bit-identical to the plain one (tests/distributed/test_ddp_overlap_world.py).
"""

from __future__ import annotations

from typing import Any

from hacrl_megatron.config import ParallelConfig

GRAD_BYTES = 4  # fp32 gradient buffer (grad_reduce_in_fp32=True)


def bucket_params(bucket_mb: int) -> int | None:
    """Parameters per gradient bucket for ``parallel.ddp_bucket_mb`` (None: megatron's default)."""
    if bucket_mb < 0:
        raise ValueError(f"parallel.ddp_bucket_mb={bucket_mb}: must be >= 0")
    return None if bucket_mb == 0 else bucket_mb * (1 << 20) // GRAD_BYTES


def ddp_config(par: ParallelConfig) -> Any:
    """megatron-core's ``DistributedDataParallelConfig`` for an agent's parallel layout."""
    from megatron.core.distributed import DistributedDataParallelConfig

    if par.overlap_param_gather and not (par.use_distributed_optimizer and par.overlap_grad_reduce):
        raise ValueError("parallel.overlap_param_gather needs parallel.use_distributed_optimizer and "
                         "parallel.overlap_grad_reduce")
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=par.overlap_grad_reduce,
        overlap_param_gather=par.overlap_param_gather, use_distributed_optimizer=par.use_distributed_optimizer,
        bucket_size=bucket_params(par.ddp_bucket_mb),
    )


def wire_overlap(ddp: Any, model_config: Any) -> None:
    """Hand the schedule the hooks megatron's training loop gives it: ``no_sync`` for every micro-batch
    but the last (needed by the overlapped reduction: without it the first micro-batch's backward would
    reduce partial gradients). Harmless without overlap (the backward hooks then never reduce)."""
    model_config.no_sync_func = ddp.no_sync


def gather_updated_params(ddp: Any) -> None:
    """With ``overlap_param_gather``, complete the all-gather of the parameters the last optimizer
    step updated (a no-op otherwise), so that what reads them next sees the new values."""
    if ddp.ddp_config.overlap_param_gather:
        ddp.start_param_sync(force_sync=True)
