"""Vocabulary-parallel bookkeeping for the log-prob kernels (Megatron's vocab-parallel CE layout).

With a tensor-parallel group of size P, rank r holds the LM-head rows [r·V_local, (r+1)·V_local)
of the global vocabulary (Megatron's ``VocabUtility`` split). Each rank computes, for every token,
statistics of its own logit shard only; this module combines them into the global log-sum-exp:

* forward: ``all_reduce(MAX)`` of the per-token shard maxima, then one ``all_reduce(SUM)`` of the
  rescaled shard sum-exp and the shard's target logit stacked together (the target lies in exactly
  one shard; the others contribute an exact 0.0) — two collectives per forward, as Megatron;
* backward: every rank holds the full ``hidden`` but only its shard's dlogits, so its dH is a
  partial sum; :func:`all_reduce_grad_hidden` sums it across the group. This is the job that
  Megatron's ``copy_to_tensor_model_parallel_region`` does in front of its column-parallel output
  layer, so ``hidden`` must **not** also pass through that region (dH would be summed twice).

All collectives take the explicit ``group``; ``None`` means an unsharded vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary.

    start: first global vocab id held by this rank (r·V_local).
    size: V_local, rows of this rank's LM-head shard.
    world: tensor-parallel size P (1 without a group); the weight covers size·world ids.
    valid: rows of this shard that are real vocabulary (ids < vocab_size); Megatron pads the
        vocabulary to a multiple of its TP size and the padding rows must not enter the softmax.
    """

    start: int
    size: int
    world: int
    valid: int

    @property
    def global_size(self) -> int:
        return self.size * self.world


def vocab_shard(local_vocab: int, group: dist.ProcessGroup | None, vocab_size: int | None = None) -> VocabShard:
    """The shard of a rank holding ``local_vocab`` rows in ``group`` (``None``: the whole vocab).

    ``vocab_size``: the real global vocabulary (default: every row of every shard is real); ids in
    [vocab_size, local_vocab·P) are padding and are excluded.
    """
    rank, world = 0, 1
    if group is not None:
        if not dist.is_initialized():
            raise RuntimeError("tp_group was given but torch.distributed is not initialized")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    padded = local_vocab * world
    real = padded if vocab_size is None else vocab_size
    if not 1 <= real <= padded:
        raise ValueError(f"vocab_size={vocab_size}: must be in [1, V_local·tp = {local_vocab}·{world} = {padded}]")
    start = rank * local_vocab
    return VocabShard(start=start, size=local_vocab, world=world, valid=min(max(real - start, 0), local_vocab))


def combine_shard_stats(
    shard_max: torch.Tensor,
    shard_sumexp: torch.Tensor,
    shard_target_logit: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global (log-sum-exp [N], target logit [N]) from per-shard statistics.

    Args:
        shard_max: [N] max over this shard's (temperature-scaled) logits of each token.
        shard_sumexp: [N] Σ_v exp(z_v − shard_max) over this shard.
        shard_target_logit: [N] z of the target token if it lies in this shard, else exactly 0.
        group: tensor-parallel group, or ``None`` when the shard is the whole vocabulary.

    The order of every reduction is fixed (elementwise ops on [N]; a two- or P-way sum inside
    the collective), so results do not depend on what else is in the batch.
    """
    if group is None:
        return shard_max + torch.log(shard_sumexp), shard_target_logit
    global_max = shard_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    packed = torch.stack([shard_sumexp * torch.exp(shard_max - global_max), shard_target_logit])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return global_max + torch.log(packed[0]), packed[1]


def all_reduce_grad_hidden(grad_hidden: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum the partial dH [N, H] of every vocab shard across ``group`` (in place; fp32 or wider).

    This is where the backward's only collective happens. It runs on the fp32 accumulator, before
    the cast to the input dtype, so that the cross-rank sum is not rounded to bf16.
    """
    if group is not None:
        dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=group)
    return grad_hidden
