"""Pure layout arithmetic shared by the config rules, the model provider and the planner (no torch).

Pipeline split: with ``L`` layers over ``pp`` stages and ``pp`` dividing ``L``, every stage holds
``L / pp`` layers. Otherwise the middle stages hold ``m = ceil(L / pp)`` layers each and the first
and last stages share the rest, ``L − (pp − 2)·m``, the first taking the smaller half: those two
stages also hold the embedding and the LM head, so they are the ones to lighten. This is
megatron-core's ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``
(Qwen3-235B-A22B's 94 layers over 4 stages: 23 / 24 / 24 / 23).

Expert layout (megatron-core): experts live on the same ``tp·cp·dp`` ranks of a pipeline stage as
attention (context parallelism ``cp`` folds into the experts' data parallelism: a token is routed on
whichever rank holds it), regrouped as ``etp`` (expert tensor parallel) × ``ep`` (expert parallel) ×
expert data parallel, so ``ep·etp`` must divide ``tp·cp·dp`` and the expert-data-parallel size is
their quotient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class LayoutError(ValueError):
    """Sizes that no layout can hold; the message names the sizes and the rule."""


def pipeline_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers of each of the ``pp`` pipeline stages, in stage order (module docstring's rule)."""
    if pp < 1 or num_layers < 1:
        raise LayoutError(f"pp={pp}, num_layers={num_layers}: both must be >= 1")
    if num_layers % pp == 0:
        return (num_layers // pp,) * pp
    if pp == 2:
        first = num_layers // 2
        return first, num_layers - first
    middle = math.ceil(num_layers / pp)
    rest = num_layers - (pp - 2) * middle
    if rest < 2:
        raise LayoutError(f"pp={pp} cannot split num_layers={num_layers}: the middle stages take {middle} layers "
                          f"each and leave {rest} for the first and last stage (each needs >= 1)")
    first = rest // 2
    return (first,) + (middle,) * (pp - 2) + (rest - first,)


def uneven_stage_sizes(num_layers: int, pp: int) -> tuple[int | None, int | None]:
    """(first, last) stage layer counts for megatron-core's uneven split, (None, None) when even."""
    split = pipeline_layers(num_layers, pp)
    if len(set(split)) == 1:
        return None, None
    return split[0], split[-1]


def layer_offset(num_layers: int, pp: int, pp_rank: int) -> int:
    """Global index of the first layer of stage ``pp_rank``."""
    return sum(pipeline_layers(num_layers, pp)[:pp_rank])


def expert_data_parallel(tp: int, dp: int, ep: int, etp: int, cp: int = 1) -> int:
    """Expert-data-parallel size ``tp·cp·dp / (ep·etp)`` (raises :class:`LayoutError` when it is no integer)."""
    if min(tp, dp, ep, etp, cp) < 1:
        raise LayoutError(f"tp={tp}, cp={cp}, dp={dp}, ep={ep}, etp={etp}: sizes must be >= 1")
    if (tp * cp * dp) % (ep * etp):
        ranks = f"tp·dp = {tp}·{dp}" if cp == 1 else f"tp·cp·dp = {tp}·{cp}·{dp}"
        raise LayoutError(f"ep·etp = {ep}·{etp} must divide {ranks}: experts are laid out over the same "
                          "ranks as attention's tensor and data parallelism")
    return tp * cp * dp // (ep * etp)


# ---- rows of a micro-batch (agents/packing.py plans them; the config rules check the budget) ----
def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (>= 1)."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Geometry:
    """How a micro-batch's sequences become the model's input rows, for counting their tokens.

    packed: one row holding every sequence back to back (else right-padded ``[B, T_max]``).
    seq_multiple: each sequence of a packed row padded to a multiple of this (context parallelism
        splits every sequence into 2·cp chunks); 1 otherwise.
    row_multiple: each row's length padded to a multiple of this (sequence parallelism splits the row
        over tp ranks); 1 otherwise.
    """

    packed: bool = False
    seq_multiple: int = 1
    row_multiple: int = 1

    def tokens(self, lengths: list[int]) -> int:
        """Tokens the model runs for one micro-batch of sequences of these ``lengths``, padding included."""
        if not lengths:
            return 0
        if self.packed:
            return round_up(sum(round_up(n, self.seq_multiple) for n in lengths), self.row_multiple)
        return len(lengths) * round_up(max(lengths), self.row_multiple)


def geometry_for(packed: bool, tp: int, sequence_parallel: bool, cp: int = 1) -> Geometry:
    """The row geometry of an agent's layout: sequence parallelism splits each row over tp ranks (its
    length a multiple of tp); context parallelism splits each sequence into 2·cp chunks (a multiple of
    2·cp, times tp under sequence parallelism, as Transformer Engine's THD attention needs)."""
    sp = tp if sequence_parallel and tp > 1 else 1
    if packed:
        return Geometry(packed=True, seq_multiple=2 * cp * sp if cp > 1 else 1, row_multiple=sp)
    return Geometry(packed=False, row_multiple=sp * (2 * cp if cp > 1 else 1))
