"""MoE models in one process: HF configs → ArchSpec, exact logits against transformers for the three
MoE families, conversion both ways (fused 3-D expert tensors in memory, per-expert names on disk),
the layout rules, and init_parallel's expert sizes."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from hacrl_megatron.models.parallel import ParallelStateError, init_parallel  # noqa: E402


def test_init_parallel_refuses_an_expert_layout_that_does_not_fit():
    with pytest.raises(ParallelStateError, match="ep·etp = 2·1 must divide tp·dp = 1·1"):
        init_parallel(1, 1, 1, ep=2)
    info = init_parallel(1, 1, 1)
    assert (info.ep, info.etp, info.ep_rank) == (1, 1, 0)
