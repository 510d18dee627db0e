"""Colocation's configuration and placement: ``rollout.colocate_offload``; colocated servers placed by
Ray (``rollout.sglang.placement: ray``), which follow each agent's Ray ranks onto every node they use
and share that node's trainer GPUs (launch/placement.py, rollout/engine_actor.py), and the precise
refusals of what such a placement cannot honour."""

from __future__ import annotations

import pytest

from hacrl_megatron.config import ConfigError, load_config
from hacrl_megatron.launch.placement import Engine, PlacementError, node_plan
from hacrl_megatron.rollout.engine_actor import SharedGPUs, colocated_shares
from hacrl_megatron.sync import resolve_weight_sync

MULTINODE = "multinode_llama70b_qwen72b"  # two agents of 32 ranks (TP4 · PP8), SGLang TP4 servers
COLOCATED = ["rollout.colocate=true", "rollout.weight_sync=auto", "agents.0.rollout_gpu_ids=[]",
             "agents.1.rollout_gpu_ids=[]"]


def test_colocate_offload_defaults_to_all_and_takes_its_three_levels():
    assert load_config("cpu_demo").rollout.colocate_offload == "all"
    for level in ("none", "optimizer", "all"):
        assert load_config("cpu_demo", [f"rollout.colocate_offload={level}"]).rollout.colocate_offload == level
    with pytest.raises(ConfigError, match=r"rollout.colocate_offload='weights': must be one of \['none', "
                                          r"'optimizer', 'all'\]"):
        load_config("cpu_demo", ["rollout.colocate_offload=weights"])


def test_colocated_servers_placed_by_ray_take_their_weights_from_disk():
    cfg = load_config(MULTINODE, COLOCATED)
    assert resolve_weight_sync(cfg.rollout) == "disk"  # auto: CUDA IPC would not reach the ranks' nodes
    assert resolve_weight_sync(load_config(MULTINODE, COLOCATED + ["rollout.sglang.placement=local"]).rollout) == "tensor"


@pytest.mark.parametrize("overrides, field, rule", [
    (["rollout.weight_sync=tensor"], "rollout.weight_sync='tensor'", "CUDA IPC .* does not reach: use disk"),
    (["agents.0.rollout_gpu_ids=[0, 1, 2, 3]"], "agents.0.rollout_gpu_ids=[0, 1, 2, 3]",
     "take the GPUs of the agent's trainer ranks on each node: leave it empty"),
    (["agents.1.parallel.tp=1", "agents.1.parallel.pp=1", "agents.1.parallel.sequence_parallel=false"],
     "agents.1.workers='auto'", "follow the agent's Ray ranks onto their nodes"),
    (["rollout.sglang.tp=64"], "rollout.sglang.tp=64", "agent 'llama70b' trains on 32 GPUs"),
])
def test_what_colocated_ray_servers_cannot_honour_is_refused_naming_the_field(overrides, field, rule):
    with pytest.raises(ConfigError, match=rf"^{field.replace('[', '.').replace(']', '.')}: .*{rule}"):
        load_config(MULTINODE, COLOCATED + overrides)


def test_every_node_s_engines_share_that_node_s_trainer_gpus():
    plan = node_plan(load_config(MULTINODE, COLOCATED), 9, 8)
    assert plan.shared and plan.head_gpu_ids is None
    llama, qwen = plan.agents
    assert llama.spans == tuple((n, 0, 8) for n in range(1, 5)) and qwen.spans == tuple((n, 0, 8) for n in range(5, 9))
    for agent in (llama, qwen):  # two TP4 servers per trainer node, on the trainer's own GPUs
        assert agent.engines == tuple(Engine(n, first, 4) for n, _, _ in agent.spans for first in (0, 4))
    assert "8 engine(s) x 4 GPUs on node 1 GPUs 0-7, node 2 GPUs 0-7" in plan.describe()[0]
    assert "(sharing the trainers' GPUs)" in plan.describe()[0]
    # agents sharing a node: each node's servers sit on that node's own trainer GPUs of the agent
    half = node_plan(load_config(MULTINODE, COLOCATED + ["agents.0.parallel.pp=2", "agents.1.parallel.pp=2"]), 3, 8)
    assert [a.engines for a in half.agents] == [(Engine(1, 0, 4), Engine(1, 4, 4)), (Engine(2, 0, 4), Engine(2, 4, 4))]


def test_placements_colocation_cannot_honour_are_refused_naming_the_field():
    with pytest.raises(PlacementError, match=r"^rollout.sglang.placement=local with rollout.colocate=true on 9 "
                                             r"nodes: .*set rollout.sglang.placement=ray"):
        node_plan(load_config(MULTINODE, COLOCATED + ["rollout.sglang.placement=local"]), 9, 8)
    with pytest.raises(PlacementError, match=r"^rollout.engine=vllm with rollout.colocate=true on 9 nodes: .*"
                                             r"use rollout.engine=sglang with rollout.sglang.placement=ray"):
        node_plan(load_config(MULTINODE, COLOCATED + ["rollout.engine=vllm", "rollout.weight_sync=disk"]), 9, 8)
    # 6 GPUs per node: node 1's six trainer GPUs hold one TP4 server and half of another
    with pytest.raises(PlacementError, match=r"^rollout.sglang.tp=4: agent 'llama70b' has 6 trainer GPU\(s\) on node "
                                             r"1; colocated servers of 4 GPUs each must tile every node's share"):
        node_plan(load_config(MULTINODE, COLOCATED), 12, 6)


def test_colocated_servers_follow_the_ranks_real_gpus():
    ranks = [{"node_id": "a" * 20, "gpu_ids": [str(g)]} for g in (3, 1, 2, 0)]
    ranks += [{"node_id": "b" * 20, "gpu_ids": [str(g)]} for g in (6, 7)]
    assert colocated_shares(ranks, 2, "x") == [SharedGPUs("a" * 20, (0, 1)), SharedGPUs("a" * 20, (2, 3)),
                                               SharedGPUs("b" * 20, (6, 7))]
    with pytest.raises(ValueError, match=r"rollout.sglang.tp=4: agent 'x' has 2 trainer GPU\(s\) on Ray node bbbb"):
        colocated_shares(ranks, 4, "x")
    with pytest.raises(ValueError, match=r"agent 'x': .* has none \(agents.N.workers: ray\)"):
        colocated_shares(None, 2, "x")
