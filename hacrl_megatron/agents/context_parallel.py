"""Context parallelism (``parallel.cp``): each micro-batch row split over the ranks of a context-parallel
group, and the response log-probs of the whole row put back together on every one of them (docs/scaling.md).

**The split** (:func:`local_positions`). Under causal attention a late position costs more than an early
one, so megatron-core cuts a row of T tokens (T a multiple of 2·cp: ``agents.packing.geometry_for`` pads
it) into 2·cp equal chunks and CP rank r keeps chunks r and 2·cp−1−r, one early and one late
(``megatron.core.utils.get_batch_on_this_cp_rank``). A packed THD row (Transformer Engine, GPU) is cut the
same way inside each sequence's padded slot (TE's ``thd_get_partitioned_indices``); its
``PackedSeqParams`` keep the global ``cu_seqlens`` and ``cu_seqlens_*_padded``, from which TE's attention
and megatron's THD RoPE find each local token's sequence and position. A right-padded row needs nothing
more: megatron's ``GPTModel`` builds the rotary table for ``T/cp · cp`` positions and keeps this rank's two
chunks of it (``get_pos_emb_on_this_cp_rank``), the same cut. Attention itself exchanges keys and values
around the ring of CP ranks inside TE (``cp_comm_type="p2p"``).

**Scored rows** (:class:`LocalScoredRows`). Output position t predicts token t+1, so a response token
is scored on the rank that holds its predicting position: every response token on exactly one rank,
at its column in that rank's ``[T/cp]`` row. Under sequence parallelism that row is split again over the
TP ranks and ``agents.lm_head.gather_scored_rows`` gathers the scored rows from it as from any row.

**Putting it back together** (:func:`context_parallel_logprobs`). Each rank's token log-probs go to
their places in the micro-batch's [N] vector (zeros elsewhere) and its per-sequence partial sums to the
[S] vector; one all-reduce (sum) over the CP group gives every rank the full ``LogProbOutput``, in the
order the unsplit micro-batch has it, and every rank computes the same loss from it. The all-reduce's
backward is the identity (:class:`_SumOverGroup`): each rank's share receives dL/d(full) once, which
is exactly the gradient of the sum with respect to that share; a summing backward would count it cp
times. The parameter gradients of the CP ranks then add up to the full row's gradient:
megatron-core's DDP reduces over the data-parallel × context-parallel group with a SUM
(``calculate_per_token_loss=True``: ``gradient_scaling_factor`` 1, ``average_in_collective`` False),
and our 3-tuple loss function skips the schedule's legacy ``loss *= cp`` scaling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hacrl_megatron.agents.batch import LogProbOutput
from hacrl_megatron.agents.lm_head import LMHead, ScoredRows, response_logprobs


def local_positions(length: int, cp: int, rank: int, slots: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """[length / cp] int64: the positions of a row of ``length`` tokens that CP rank ``rank`` of ``cp``
    holds, in the order it holds them (its row is ``row[:, positions]``).

    ``slots``: offsets [K + 1] of a packed row's padded slots (``cu_seqlens_q_padded``; 0 first,
    ``length`` last), each slot cut on its own; None: the row is one slot (megatron's split of a
    right-padded row). Every slot's length must be a multiple of 2·cp.
    """
    if not 0 <= rank < cp:
        raise ValueError(f"context-parallel rank {rank} outside cp={cp}")
    bounds = [0, length] if slots is None else [int(x) for x in slots]
    if bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"slot offsets {bounds} must run from 0 to the row length {length}")
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if (end - start) % (2 * cp):
            raise ValueError(f"a slot of {end - start} tokens at {start} does not split into 2·cp = {2 * cp} chunks "
                             "(agents.packing.geometry_for pads rows and slots to that multiple)")
        chunk = (end - start) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):  # one early and one late chunk: balanced causal attention
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class LocalScoredRows:
    """The response tokens of one micro-batch whose predicting position this CP rank holds: the
    ``agents.lm_head.ScoredRows`` of its local row, and where each goes in the micro-batch's full output.

    rows, cols: [n] int64, row and column in this rank's ``[B, T/cp]`` row of each predicting position.
    targets: [n] int64 token ids. cu_seqlens: [s + 1] offsets of the s sequences with at least one local
    token (the kernel wants no empty sequence); seq_len: [s] their local counts.
    token_index: [n] each token's index among the micro-batch's N response tokens (ascending: the local
    tokens keep the global order). seq_index: [s] those sequences' indices among its S.
    stand_in: no response token lies on this rank; rows/cols/targets then hold one stand-in row (row 0,
    column 0, target 0) whose log-prob enters the output multiplied by 0, so the rank's loss still
    depends on its model output and its backward runs through the model like every other rank's (TE's
    attention backward exchanges gradients around the whole ring).
    """

    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_len: torch.Tensor
    token_index: torch.Tensor
    seq_index: torch.Tensor
    stand_in: bool = False


def scored_rows_on_rank(mb: ScoredRows, positions: torch.Tensor, length: int) -> LocalScoredRows:
    """The part of ``mb``'s scored rows (global columns of rows of ``length``) that a rank holding
    ``positions`` ([T/cp], :func:`local_positions`) scores."""
    device = mb.cols.device
    local_col = torch.full((length,), -1, dtype=torch.long, device=device)
    local_col[positions.to(device)] = torch.arange(positions.numel(), device=device)
    at = local_col[mb.cols]  # [N] local column of each predicting position, -1 elsewhere
    mine = at >= 0
    token_index = torch.nonzero(mine).flatten()
    seq_len = mb.seq_len.to(device)
    seq_of_token = torch.repeat_interleave(torch.arange(seq_len.numel(), device=device), seq_len)
    counts = torch.bincount(seq_of_token[mine], minlength=seq_len.numel())
    seq_index = torch.nonzero(counts > 0).flatten()
    if token_index.numel() == 0:
        one = torch.ones(1, dtype=torch.long, device=device)
        zero = torch.zeros(1, dtype=torch.long, device=device)
        return LocalScoredRows(zero, zero, zero, torch.cat([zero, one]), one, token_index, seq_index, stand_in=True)
    local_len = counts[seq_index]
    cu = torch.zeros(local_len.numel() + 1, dtype=torch.long, device=device)
    cu[1:] = torch.cumsum(local_len, 0)
    return LocalScoredRows(mb.rows[mine], at[mine], mb.targets[mine], cu, local_len, token_index, seq_index)


@dataclass(frozen=True)
class ContextParallelSplit:
    """How one micro-batch was split over the context-parallel group (``MicroBatch.context_parallel``).

    group: the CP process group (megatron's ``get_context_parallel_group()``); size, rank: cp and this
    rank's place in it. row_len: T of the full row (megatron's schedule divides the sequence length it
    is given by cp itself). positions: [T/cp] int64, the global positions this rank holds, in local order.
    scored: :class:`LocalScoredRows`.
    """

    group: Any
    size: int
    rank: int
    row_len: int
    positions: torch.Tensor
    scored: LocalScoredRows


def split_micro_batch(mb: Any, cp: int, rank: int, group: Any) -> Any:
    """``mb`` (an ``agents.schedule.MicroBatch`` of full rows) as CP rank ``rank`` of ``cp`` runs it: its
    ``tokens`` and ``position_ids`` become ``[B, T/cp]`` (this rank's chunks), ``context_parallel`` records
    the split; the global scored rows, ``cu_seqlens`` and ``seq_len`` stay (they describe the full output
    that :func:`context_parallel_logprobs` assembles)."""
    if mb.attention_mask is not None:
        raise ValueError("context parallelism needs Transformer Engine's attention: a packed row with an explicit "
                         "mask (the CPU layer spec) cannot be split over context-parallel ranks")
    length = int(mb.tokens.shape[1])
    slots = None if mb.packed_seq_params is None else mb.packed_seq_params.cu_seqlens_q_padded.tolist()
    positions = local_positions(length, cp, rank, slots).to(mb.tokens.device)
    split = ContextParallelSplit(group, cp, rank, length, positions, scored_rows_on_rank(mb, positions, length))
    return dataclasses.replace(mb, tokens=mb.tokens[:, positions].contiguous(),
                               position_ids=mb.position_ids[:, positions].contiguous(), context_parallel=split)


def split_for_context_parallel(micro: list[Any], cp: int, rank: int) -> list[Any]:
    """Every micro-batch of ``micro`` split for this rank of megatron's context-parallel group (as is at cp = 1)."""
    if cp == 1:
        return micro
    from megatron.core import parallel_state as mpu

    group = mpu.get_context_parallel_group()
    return [split_micro_batch(mb, cp, rank, group) for mb in micro]


class _SumOverGroup(torch.autograd.Function):
    """Forward: all-reduce (sum) over ``group``. Backward: the identity: every rank of the group computes
    the same loss from the sum, so dL/d(share) = dL/d(sum) on each rank, once (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        out = x.clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def sum_over_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over the ranks of ``group``, differentiable with an identity backward (:class:`_SumOverGroup`)."""
    return _SumOverGroup.apply(x, group)


def context_parallel_logprobs(output: torch.Tensor, mb: Any, temperature: float, head: LMHead) -> LogProbOutput:
    """The full :class:`LogProbOutput` of a split micro-batch (token log-probs [N] in the unsplit
    micro-batch's order, sums [S]), the same on every CP rank, from this rank's model output
    (``[B, T/cp, ·]``; ``[B, T/(cp·tp), H]`` under sequence parallelism)."""
    split: ContextParallelSplit = mb.context_parallel
    scored = split.scored
    local = response_logprobs(output, scored, temperature, head)
    n, s = int(mb.targets.numel()), int(mb.seq_len.numel())
    tokens, sums = local.token_logps, local.seq_logp_sum
    if scored.stand_in:  # nothing of this micro-batch on this rank: zeros that still depend on the output
        flat = tokens.new_zeros(n + s) + tokens.sum() * 0
    else:
        flat = torch.cat([tokens.new_zeros(n).index_copy(0, scored.token_index, tokens),
                          sums.new_zeros(s).index_copy(0, scored.seq_index, sums.to(tokens.dtype))])
    flat = sum_over_group(flat, split.group)  # one all-reduce for both
    return LogProbOutput(token_logps=flat[:n], cu_seqlens=mb.cu_seqlens, seq_logp_sum=flat[n:], seq_len=mb.seq_len)


def micro_batch_logprobs(output: torch.Tensor, mb: Any, temperature: float, head: LMHead) -> LogProbOutput:
    """Response log-probs of micro-batch ``mb`` from the last stage's output: split over context-parallel
    ranks (:func:`context_parallel_logprobs`) or whole (``agents.lm_head.response_logprobs``)."""
    if getattr(mb, "context_parallel", None) is not None:
        return context_parallel_logprobs(output, mb, temperature, head)
    return response_logprobs(output, mb, temperature, head)
