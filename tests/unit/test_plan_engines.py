"""Engine GPUs split by rollout cost in whole engines across as many nodes as needed, never an
engine across two nodes, preferring nodes that are neither the controller's nor a trainer's; the
planner's placement is what ``hacrl launch`` reads back from the planned config."""

from __future__ import annotations

from argparse import Namespace

import pytest

from hacrl_megatron.config import load_config
from hacrl_megatron.launch.placement import (
    Engine,
    PlacementError,
    engine_slots,
    free_gpus,
    node_plan,
    place_engines,
    place_trainers,
    split_engines,
)

PAIR = "examples/multi_node_70b/llama405b_with_llama8b.yaml"
H100, H200 = 80e9 / 2**30, 141e9 / 2**30


def _plan(preset: str, nodes: int, gpu: str = "h100", gib: float = H100) -> dict:
    from hacrl_megatron.plan.cli import _experiment

    return _experiment(Namespace(preset=preset, overrides=[], nodes=nodes, gpus_per_node=8, gpu_memory_gib=gib,
                                 gpu=gpu))


def _spans(plan: dict) -> list[tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]]:
    return [([(t["node"], t["first_gpu"], t["gpus"]) for t in a["trainer"]],
             [(e["node"], e["first_gpu"], e["gpus"]) for e in a["engines"]]) for a in plan["placement"]["agents"]]


def _launch_view(preset: str, overrides: list[str], nodes: int) -> list:
    """What ``hacrl launch`` expects for the planned config: the same spans."""
    plan = node_plan(load_config(preset, overrides), nodes, 8)
    return [(list(a.spans), [(e.node, e.first, e.gpus) for e in a.engines]) for a in plan.agents]


def test_split_in_proportion_at_least_one_each():
    assert split_engines([1, 1], 2) == [1, 1]
    assert split_engines([3, 1], 8) == [6, 2]
    assert split_engines([405, 8], 6) == [5, 1]  # the 8B keeps one engine
    assert split_engines([100, 1, 1], 4) == [2, 1, 1]
    assert split_engines([1, 1], 3) == [2, 1]  # ties go to the earlier agent
    with pytest.raises(PlacementError, match="2 whole engine"):
        split_engines([1, 1, 1], 2)


def test_four_nodes_of_two_gpus_engines_off_the_controller_and_trainer_nodes():
    """The simulated cluster's shape: trainers on nodes 1 and 2, engines on node 3 first, then the
    controller's node 0 (its GPUs are Ray's like any other node's)."""
    trainers = place_trainers([2, 2], 4, 2)
    assert trainers == [((1, 0, 2),), ((2, 0, 2),)]
    assert free_gpus(trainers, 4, 2) == {0: [0, 1], 1: [], 2: [], 3: [0, 1]}
    assert place_engines([1, 1], 1, trainers, 4, 2) == [(Engine(3, 0, 1),), (Engine(3, 1, 1),)]
    assert place_engines([2, 2], 1, trainers, 4, 2) == [(Engine(3, 0, 1), Engine(3, 1, 1)),
                                                        (Engine(0, 0, 1), Engine(0, 1, 1))]
    # TP2 engines: one per free node, never split across nodes
    assert place_engines([1, 1], 2, trainers, 4, 2) == [(Engine(3, 0, 2),), (Engine(0, 0, 2),)]
    with pytest.raises(PlacementError, match=r"agent 1: 1 engine\(s\) of 2 GPUs do not fit the free GPUs"):
        place_engines([2, 1], 2, trainers, 4, 2)


def test_trainer_leftovers_hold_whole_engines_only():
    trainers = place_trainers([3, 2], 3, 4)  # node 1 GPUs 0-2, then node 1 GPU 3 + node 2 GPU 0
    assert trainers == [((1, 0, 3),), ((1, 3, 1), (2, 0, 1))]
    free = free_gpus(trainers, 3, 4)
    assert free == {0: [0, 1, 2, 3], 1: [], 2: [1, 2, 3]} and engine_slots(free, 2) == 3
    # agent 1's own trainer node (2) comes last for its engines, after the controller's node
    assert place_engines([1, 2], 2, trainers, 3, 4) == [(Engine(0, 0, 2),), (Engine(0, 2, 2), Engine(2, 1, 2))]


def test_trainers_start_on_node_0_only_when_the_others_are_too_few():
    assert place_trainers([8, 8], 3, 8) == [((1, 0, 8),), ((2, 0, 8),)]
    assert place_trainers([8, 8], 2, 8) == [((0, 0, 8),), ((1, 0, 8),)]
    with pytest.raises(PlacementError, match="need 24 GPUs, the job has 16"):
        place_trainers([16, 8], 2, 8)


def test_70b_preset_placement_and_launch_agree():
    plan = _plan("multinode_llama70b_qwen72b", 9)
    expected = [([(n, 0, 8) for n in (1, 2, 3, 4)], [(0, 0, 4)]), ([(n, 0, 8) for n in (5, 6, 7, 8)], [(0, 4, 4)])]
    assert _spans(plan) == expected
    assert _launch_view("multinode_llama70b_qwen72b", plan["overrides"], 9) == expected


def test_405b_with_8b_on_16_h100_nodes_is_refused_by_the_engine_limit(capsys):
    from hacrl_megatron.cli import main

    assert main(["plan", "--preset", PAIR, "--nodes", "16", "--gpus-per-node", "8", "--gpu-memory-gib", "74.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("hacrl plan: agent 'llama405b': no rollout engine fits on one node: 756 GiB of bf16 weights are "
                   "94.5 GiB per GPU at TP8, the largest engine TP on a 8-GPU node, more than a GPU's 74.5 GiB; an "
                   "engine never spans nodes")


def test_405b_with_8b_on_16_h200_nodes_gets_engines_on_six_nodes():
    plan = _plan(PAIR, 16, "h200", H200)
    assert all(a["fits"] for a in plan["agents"])
    assert [(a["layout"]["tp"], a["layout"]["pp"], a["layout"]["dp"]) for a in plan["agents"]] == [(4, 18, 1),
                                                                                                  (1, 1, 8)]
    expected = [([(n, 0, 8) for n in range(1, 10)], [(n, 0, 8) for n in range(11, 16)]),  # 5 TP8 engines
                ([(10, 0, 8)], [(0, 0, 8)])]  # the 8B: one engine, on the controller's node
    assert _spans(plan) == expected
    assert "agents.0.rollout_gpu_ids=[" + ", ".join(map(str, range(88, 128))) + "]" in plan["overrides"]
    assert "agents.1.rollout_gpu_ids=[0, 1, 2, 3, 4, 5, 6, 7]" in plan["overrides"]
    assert _launch_view(PAIR, plan["overrides"], 16) == expected
    assert plan["step_time_s"] == pytest.approx(1513.8, abs=0.5)  # docs/planner.md, 405B with 8B
    assert plan["step_time_one_step_off_s"] == pytest.approx(1056.6, abs=0.5)


def test_one_node_overlap_plan_reserves_its_engine_gpus_from_ray():
    plan = _plan("paper_qwen3_4b_with_instruct", 1)["overlap_plan"]
    # one TP2 engine per agent after its two trainer GPUs (the searched best for one_step_off; two TP1
    # engines come within the post-sync probe's time of it: TP2 prefills the probe faster)
    expected = [([(0, 0, 2)], [(0, 2, 2)]), ([(0, 4, 2)], [(0, 6, 2)])]
    assert _spans(plan) == expected
    assert _launch_view("paper_qwen3_4b_with_instruct", plan["overrides"], 1) == expected
    launch = node_plan(load_config("paper_qwen3_4b_with_instruct", plan["overrides"]), 1, 8)
    assert launch.head_gpu_ids == (0, 1, 4, 5) and not launch.shared


def test_launch_refuses_engines_that_span_nodes_or_overlap_trainers():
    base = ["rollout.sglang.tp=4"]
    with pytest.raises(PlacementError, match=r"engine GPUs \[6, 7, 8, 9\] are not 4 consecutive GPUs of one node"):
        node_plan(load_config("multinode_llama70b_qwen72b", base + ["agents.0.rollout_gpu_ids=[6, 7, 8, 9]"]), 9, 8)
    with pytest.raises(PlacementError, match="rollout_gpu_ids has GPU 72, the job has 72"):
        node_plan(load_config("multinode_llama70b_qwen72b", ["agents.1.rollout_gpu_ids=[72, 73, 74, 75]"]), 9, 8)
    with pytest.raises(PlacementError, match=r"engine on node 1 GPUs \[0, 1, 2, 3\] overlaps the trainer ranks of "
                                             r"agent 'llama70b'"):
        node_plan(load_config("multinode_llama70b_qwen72b", ["agents.0.rollout_gpu_ids=[8, 9, 10, 11]"]), 9, 8)
