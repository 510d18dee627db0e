"""The expert layout (parallel.ep, parallel.etp), the MoE model fields and uneven pipeline splits,
validated before any work starts (each failure names the field, its value and the rule)."""

from __future__ import annotations

import pytest

from hacrl_megatron.config import ConfigError, load_config
from hacrl_megatron.config.layout import (
    LayoutError,
    expert_data_parallel,
    layer_offset,
    pipeline_layers,
    uneven_stage_sizes,
)

MOE = ["agents.0.model.arch=qwen3_moe", "agents.0.model.num_experts=4", "agents.0.model.moe_topk=2",
       "agents.0.model.moe_ffn_hidden_size=64"]


def test_pipeline_split_even_and_uneven():
    assert pipeline_layers(8, 4) == (2, 2, 2, 2)
    assert pipeline_layers(94, 4) == (23, 24, 24, 23)  # Qwen3-235B-A22B at PP4
    assert pipeline_layers(94, 2) == (47, 47)
    assert pipeline_layers(3, 2) == (1, 2)
    assert pipeline_layers(80, 3) == (26, 27, 27)
    assert pipeline_layers(4, 3) == (1, 2, 1)
    assert uneven_stage_sizes(94, 4) == (23, 23) and uneven_stage_sizes(96, 4) == (None, None)
    assert [layer_offset(94, 4, r) for r in range(4)] == [0, 23, 47, 71]
    for layers in range(1, 40):
        for pp in range(1, layers + 1):
            try:
                split = pipeline_layers(layers, pp)
            except LayoutError:
                continue
            assert sum(split) == layers and min(split) >= 1 and len(split) == pp
            assert len(set(split[1:-1])) <= 1  # megatron: the middle stages are even
    with pytest.raises(LayoutError, match="pp=5 cannot split num_layers=4"):
        pipeline_layers(4, 5)


def test_expert_data_parallel_size():
    assert expert_data_parallel(4, 8, 8, 1) == 4  # TP4·DP8 ranks regrouped as EP8 × EDP4
    assert expert_data_parallel(1, 2, 2, 1) == 1
    assert expert_data_parallel(2, 2, 2, 2) == 1
    with pytest.raises(LayoutError, match="ep·etp = 4·1 must divide tp·dp = 1·2"):
        expert_data_parallel(1, 2, 4, 1)


def test_moe_agent_config_is_valid():
    cfg = load_config("cpu_demo", MOE + ["agents.0.parallel.dp=2", "agents.0.parallel.ep=2",
                                         "agents.0.model.moe_aux_loss_coeff=0.01", "agents.0.model.moe_routing_replay=true"])
    p = cfg.agents[0].parallel
    assert (p.world_size, p.ep, p.expert_dp) == (2, 2, 1)


@pytest.mark.parametrize("overrides, fragment", [
    (["agents.0.parallel.ep=2", "agents.0.parallel.dp=2"],
     "agents.0.parallel.ep=(2, 1): expert parallelism (ep, etp) needs a Mixture-of-Experts arch"),
    (MOE + ["agents.0.parallel.ep=2"], "agents.0.parallel.ep=2: ep·etp = 2·1 must divide tp·dp = 1·1"),
    (MOE + ["agents.0.parallel.ep=3", "agents.0.parallel.dp=3"],
     "agents.0.parallel.ep=3: must divide model.num_experts=4"),
    (MOE + ["agents.0.parallel.etp=3", "agents.0.parallel.ep=2", "agents.0.parallel.dp=6"],
     "agents.0.parallel.etp=3: must divide the expert FFN width 64"),
    (MOE + ["agents.0.parallel.tp=2", "agents.0.parallel.sequence_parallel=true"],
     "agents.0.parallel.etp=1: with ep=1 the experts must be split like attention: set etp = tp = 2"),
    (MOE + ["agents.0.parallel.tp=2", "agents.0.parallel.etp=2"],
     "agents.0.parallel.sequence_parallel=False: MoE layers with tp=2 > 1 need"),
    (MOE + ["agents.0.model.moe_topk=5"], "agents.0.model.moe_topk=5: must lie in [1, num_experts=4]"),
    (MOE + ["agents.0.model.num_experts=1", "agents.0.model.moe_topk=1"],
     "agents.0.model.num_experts=1: an MoE arch (qwen3_moe) needs >= 2 experts"),
    (MOE + ["agents.0.model.moe_aux_loss_coeff=-1"], "agents.0.model.moe_aux_loss_coeff=-1.0: must be >= 0"),
    (MOE + ["agents.0.model.shared_expert_ffn_hidden_size=32"],
     "a shared expert is part of qwen2_moe only"),
    (["agents.0.model.num_experts=4"], "agents.0.model.num_experts=4: must be 0 for the dense arch 'llama'"),
    (["agents.0.model.moe_routing_replay=true"], "agents.0.model.moe_routing_replay=True: routing replay needs"),
    (MOE + ["agents.0.backend=hf"], "Mixture-of-Experts agents train with backend: megatron"),
    (MOE + ["agents.0.parallel.etp=0"], "agents.0.parallel.etp=0: must be >= 1"),
    (MOE + ["agents.0.model.moe_routing_replay=true", "agents.0.parallel.recompute=full", "agents.0.parallel.pp=2"],
     "agents.0.model.moe_routing_replay=True: with parallel.recompute=full and pp > 1"),
])
def test_bad_moe_layouts_fail_with_the_field_named(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("cpu_demo", overrides)
    assert fragment in str(err.value)


def test_tp_with_sequence_parallel_is_accepted_for_moe():
    cfg = load_config("cpu_demo", MOE + ["agents.0.parallel.tp=2", "agents.0.parallel.sequence_parallel=true",
                                         "agents.0.parallel.ep=2", "agents.0.parallel.dp=1"])
    assert cfg.agents[0].parallel.expert_dp == 1


def test_uneven_pipeline_split_is_accepted():
    cfg = load_config("cpu_demo", ["agents.0.parallel.pp=3"])  # 4 layers: 1 / 2 / 1
    assert cfg.agents[0].parallel.world_size == 3
