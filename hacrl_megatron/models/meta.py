"""Meta-device builds of one rank of a layout: stand-in process groups, no world, no memory.

megatron-core sizes every layer from the process groups it is given (``pg_collection``): the
tensor-parallel group splits attention and dense MLPs, the expert groups split the experts. Fake
groups (torch's ``fake`` backend: sizes and ranks only, collectives are no-ops) of the right sizes
therefore build exactly the shapes a real rank holds, which is how the planner counts 235B-parameter
layouts on a laptop (docs/planner.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from hacrl_megatron.config.layout import LayoutError, expert_data_parallel


class MetaLayoutError(ValueError):
    """A meta build asked for a rank or sizes outside its layout."""


def _fake_group(rank: int, size: int) -> Any:
    """A torch ``FakeProcessGroup`` (the ``fake`` backend: sizes and ranks, collectives are no-ops)."""
    from torch._C._distributed_c10d import FakeProcessGroup

    if hasattr(FakeProcessGroup, "_create_internal"):  # torch >= 2.9
        return FakeProcessGroup._create_internal(rank, size)
    return FakeProcessGroup(rank, size)


def default_dp(tp: int, ep: int, etp: int) -> int:
    """The smallest data-parallel size whose ``tp·dp`` ranks hold ``ep·etp`` expert shards."""
    return ep * etp // math.gcd(tp, ep * etp)


def stand_in_groups(tp: int, pp: int, tp_rank: int, pp_rank: int, ep: int = 1, etp: int = 1,
                    dp: int | None = None) -> Any:
    """megatron-core ``ProcessGroupCollection`` of fake groups for one rank of a ``tp`` × ``pp`` × ``dp``
    layout whose experts are laid out ``etp`` × ``ep`` × expert-DP over the same ``tp·dp`` ranks.

    The rank is the first data-parallel replica's (its expert-parallel rank is 0: every EP rank holds
    as many experts). Only model construction reads the groups (sizes and ranks); ``embd`` is None so
    that a tied embedding on the last stage is not all-reduced with the first (nothing to copy on meta).
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    dp = dp if dp is not None else default_dp(tp, ep, etp)
    try:
        edp = expert_data_parallel(tp, dp, ep, etp)
    except LayoutError as err:
        raise MetaLayoutError(str(err)) from None
    fake = _fake_group
    groups = dict(tp=fake(tp_rank, tp), pp=fake(pp_rank, pp), cp=fake(0, 1), tp_cp=fake(tp_rank, tp),
                  dp=fake(0, dp), dp_cp=fake(0, dp), tp_dp_cp=fake(tp_rank, tp * dp), embd=None, pos_embd=None)
    if ep * etp > 1 or edp != dp:
        etp_rank = tp_rank % etp
        groups.update(ep=fake(0, ep), expt_tp=fake(etp_rank, etp), expt_dp=fake(0, edp),
                      tp_ep=fake(etp_rank, etp * ep), tp_ep_pp=fake(etp_rank, etp * ep * pp))
    else:  # dense layouts and MoE at EP = ETP = 1: the expert groups are trivial
        groups.update(ep=fake(0, 1), expt_tp=fake(0, 1), expt_dp=fake(0, dp), tp_ep=fake(0, 1),
                      tp_ep_pp=fake(0, pp))
    return ProcessGroupCollection(**groups)


@contextlib.contextmanager
def meta_build_context() -> Iterator[None]:
    """Parameters on ``meta``; a one-rank ``fake`` default world while building when none exists
    (megatron-core reads group sizes only once ``torch.distributed`` is initialised), removed after.
    On a machine without CUDA the compatibility layer is switched on first: the MoE token dispatcher
    creates a CUDA stream in its constructor (docs/cpu_compat.md)."""
    import torch.distributed as dist

    from hacrl_megatron.models.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    created = False
    if not dist.is_initialized():
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    try:
        with torch.device("meta"):
            yield
    finally:
        if created:
            dist.destroy_process_group()
