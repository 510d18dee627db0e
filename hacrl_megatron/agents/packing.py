"""Token-budget micro-batches: which sequences of a mini-batch each data-parallel rank runs, in which micro-batch.

With ``train.max_tokens_per_microbatch`` set, a mini-batch (one of HACPO's M updates, eq. 14's m) is cut
by tokens instead of by a sequence count (docs/scaling.md):

1. **Ranks.** Sequences are dealt longest first to the rank holding the fewest tokens that still has room,
   each rank taking as many sequences as the contiguous split would (counts differ by at most one), so
   the ranks' token loads are balanced.
2. **Micro-batches.** Each rank groups its sequences under the budget. Padded rows (``[B, T_max]``) take
   consecutive runs of the length-sorted list, so each micro-batch holds sequences of similar length and
   costs ``B · T_max``; packed rows (one row per micro-batch, :func:`~hacrl_megatron.agents.schedule.
   make_packed_micro_batch`) are filled first-fit-decreasing and cost the sum of their lengths.
3. **Equal counts.** Every rank runs the same number of micro-batches (megatron's pipeline schedule and
   the gradient all-reduce need that): a rank with fewer splits its costliest micro-batch in two until the
   counts agree; a rank that runs out of sequences to split gets a *filler* micro-batch, a copy of its
   shortest sequence whose loss counts zero (only when nearly every sequence needs a micro-batch alone).

The plan depends on the sequence lengths only, so every rank computes the same one from the whole
mini-batch without communicating. Which sequences share a micro-batch does not change the update: the
loss of every micro-batch is already divided by the mini-batch's global normaliser (docs/algorithm.md §7)
and gradients are summed, so the update equals the padded path's up to float summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

from hacrl_megatron.config.layout import Geometry, geometry_for, round_up

__all__ = ["Geometry", "MicroBatchPlan", "count_micro_batches", "deal_to_ranks", "geometry_for",
           "plan_micro_batches", "round_up"]


@dataclass(frozen=True)
class MicroBatchPlan:
    """Micro-batches of every data-parallel rank for one mini-batch.

    ranks[r][j]: indices into the mini-batch of the sequences in rank r's micro-batch j (every rank
        has the same number of micro-batches).
    fillers[r][j]: True when that micro-batch only repeats a sequence to keep the counts equal: its
        loss and its log-probs are discarded.
    """

    ranks: tuple[tuple[tuple[int, ...], ...], ...]
    fillers: tuple[tuple[bool, ...], ...]

    def rank_indices(self, rank: int) -> list[int]:
        """The sequences rank ``rank`` scores (fillers excluded), in micro-batch order."""
        return [i for mb, fill in zip(self.ranks[rank], self.fillers[rank]) if not fill for i in mb]

    def tokens(self, lengths: list[int], geometry: Geometry) -> tuple[int, int]:
        """(real tokens, tokens the model runs) over every rank's micro-batches: 1 − real / run is the
        padding fraction (fillers count as padding)."""
        real = sum(lengths)
        run = sum(geometry.tokens([lengths[i] for i in mb]) for rank in self.ranks for mb in rank)
        return real, run


def deal_to_ranks(lengths: list[int], dp: int) -> list[list[int]]:
    """Sequence indices per data-parallel rank: longest first to the least-loaded rank with room.

    Rank r takes exactly as many sequences as the contiguous split would give it (n // dp, one more for
    the first n % dp ranks), so counts differ by at most one and every rank gets one when n >= dp.
    """
    n = len(lengths)
    if n < dp:
        raise ValueError(f"a batch of {n} sequences cannot be split over data-parallel size {dp}")
    room = [n // dp + (1 if r < n % dp else 0) for r in range(dp)]
    load, out = [0] * dp, [[] for _ in range(dp)]
    for i in sorted(range(n), key=lambda k: (-lengths[k], k)):
        rank = min((r for r in range(dp) if len(out[r]) < room[r]), key=lambda r: (load[r], r))
        out[rank].append(i)
        load[rank] += lengths[i]
    return out


def _group(indices: list[int], lengths: list[int], budget: int, geometry: Geometry) -> list[list[int]]:
    """One rank's sequences in micro-batches of at most ``budget`` tokens (a longer sequence goes alone)."""
    order = sorted(indices, key=lambda k: (-lengths[k], k))
    groups: list[list[int]] = []
    if geometry.packed:  # first-fit decreasing
        for i in order:
            for g in groups:
                if geometry.tokens([lengths[k] for k in g] + [lengths[i]]) <= budget:
                    g.append(i)
                    break
            else:
                groups.append([i])
        return groups
    for i in order:  # consecutive runs of similar length: little padding per row
        if groups and geometry.tokens([lengths[k] for k in groups[-1]] + [lengths[i]]) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _split_costliest(groups: list[list[int]], lengths: list[int], geometry: Geometry) -> bool:
    """Split the costliest micro-batch of two or more sequences in two, in place; False if none has two."""
    splittable = [g for g in groups if len(g) > 1]
    if not splittable:
        return False
    g = max(splittable, key=lambda x: (geometry.tokens([lengths[k] for k in x]), -groups.index(x)))
    at = groups.index(g)
    if geometry.packed:  # alternate longest-first: two halves of about equal tokens
        first, second = g[0::2], g[1::2]
    else:  # keep runs of similar length together
        first, second = g[: len(g) // 2], g[len(g) // 2 :]
    groups[at : at + 1] = [first, second]
    return True


def plan_micro_batches(lengths: list[int], dp: int, budget: int, geometry: Geometry) -> MicroBatchPlan:
    """The token-budget micro-batches of one mini-batch whose sequences have these ``lengths`` (tokens,
    prompt + response), for ``dp`` data-parallel ranks; see the module docstring."""
    if budget < 1:
        raise ValueError(f"max_tokens_per_microbatch={budget}: must be >= 1")
    per_rank = [_group(idx, lengths, budget, geometry) for idx in deal_to_ranks(lengths, dp)]
    count = max(len(g) for g in per_rank)
    fillers = []
    for groups in per_rank:
        while len(groups) < count and _split_costliest(groups, lengths, geometry):
            pass
        fill = [False] * len(groups)
        if len(groups) < count:  # every sequence already alone: repeat the shortest, its loss counts zero
            shortest = min((g[0] for g in groups), key=lambda k: (lengths[k], k))
            fill += [True] * (count - len(groups))
            groups += [[shortest] for _ in range(count - len(groups))]
        fillers.append(tuple(fill))
    return MicroBatchPlan(ranks=tuple(tuple(tuple(g) for g in groups) for groups in per_rank),
                          fillers=tuple(fillers))


def count_micro_batches(n: int, size: int, dp: int) -> MicroBatchPlan:
    """The sequence-count plan (no token budget): rank r's contiguous share of the ``n`` sequences (the
    first n % dp ranks take one more) in consecutive groups of ``size``. Ranks may then run different
    numbers of micro-batches, as they always have without a budget (the gradient all-reduce waits for
    the last one)."""
    if n < dp:
        raise ValueError(f"a batch of {n} sequences cannot be split over data-parallel size {dp}")
    if size < 1:
        raise ValueError(f"micro_batch_size={size} must be >= 1")
    ranks, start = [], 0
    for r in range(dp):
        take = n // dp + (1 if r < n % dp else 0)
        ranks.append(tuple(tuple(range(i, min(i + size, start + take))) for i in range(start, start + take, size)))
        start += take
    return MicroBatchPlan(ranks=tuple(ranks), fillers=tuple(tuple(False for _ in x) for x in ranks))
