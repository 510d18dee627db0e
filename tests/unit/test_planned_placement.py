"""Trainers and engines on the nodes the plan names (no Ray cluster: a fake ``ray`` module).

A launched job's nodes carry ``hacrl_node_<k>``; the plan's trainer spans (launch/placement.py,
trainers in config order on consecutive GPUs from node 1) become one pinned bundle per rank, and a
placement that does not come names the agent, the node and what holds its GPUs."""

from __future__ import annotations

import dataclasses

import pytest

from hacrl_megatron.agents.ray_placement import RayAgentError, pinned_bundles
from hacrl_megatron.config import validate
from hacrl_megatron.ray_nodes import describe_node, gpus_per_node, job_nodes, placement_timeout
from tests.e2e.test_trainer import tiny_exp


class FakeRay:
    """``cluster_resources``, ``nodes`` and ``util.placement_group_table`` of a 4-node job, 2 GPUs each."""

    def __init__(self, nodes: int = 4, groups: dict | None = None, gpus: int = 2) -> None:
        gpu = {"GPU": float(gpus)} if gpus else {}
        self._nodes = [{"NodeID": f"id{k}", "Alive": True, "NodeManagerAddress": f"127.0.0.{k + 2}",
                        "Resources": {**gpu, "CPU": 2.0, f"hacrl_node_{k}": 1000.0}} for k in range(nodes)]
        table = groups or {}
        self.util = type("util", (), {"placement_group_table": staticmethod(lambda: table)})

    def cluster_resources(self) -> dict:
        out: dict = {}
        for n in self._nodes:
            for k, v in n["Resources"].items():
                out[k] = out.get(k, 0.0) + v
        return out

    def nodes(self) -> list:
        return self._nodes


def test_job_nodes_and_gpus_per_node(monkeypatch):
    ray = FakeRay()
    assert job_nodes(ray) == [0, 1, 2, 3]
    monkeypatch.delenv("HACRL_GPUS_PER_NODE", raising=False)
    with pytest.raises(ValueError, match=r"agent 'llama': this Ray cluster's 4 nodes carry hacrl_node_<k> resources "
                                         r".* \$HACRL_GPUS_PER_NODE is unset"):
        gpus_per_node(ray, "agent 'llama'")
    assert gpus_per_node(FakeRay(nodes=1), "x") is None  # one node: nothing to map
    assert gpus_per_node(FakeRay(gpus=0), "x") is None  # a CPU job (no --gpus-per-node): no GPUs to place
    monkeypatch.setenv("HACRL_GPUS_PER_NODE", "2")
    assert gpus_per_node(ray, "x") == 2
    monkeypatch.setenv("HACRL_GPUS_PER_NODE", "two")
    with pytest.raises(ValueError, match=r"\$HACRL_GPUS_PER_NODE='two': must be a positive GPU count"):
        gpus_per_node(ray, "x")


def test_placement_timeout(monkeypatch):
    monkeypatch.delenv("HACRL_PLACEMENT_TIMEOUT_S", raising=False)
    assert placement_timeout() == 300.0
    monkeypatch.setenv("HACRL_PLACEMENT_TIMEOUT_S", "12.5")
    assert placement_timeout() == 12.5
    monkeypatch.setenv("HACRL_PLACEMENT_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="HACRL_PLACEMENT_TIMEOUT_S='0'"):
        placement_timeout()


def test_describe_node_names_the_groups_holding_its_gpus():
    groups = {"a": {"name": "hacrl-qwen3-engines-1a2b", "state": "CREATED", "bundles": {0: {"GPU": 2.0, "CPU": 1.0}},
                    "bundles_to_node_id": {0: "id1"}},
              "b": {"name": "hacrl-llama-9f", "state": "CREATED", "bundles": {0: {"GPU": 1.0}, 1: {"GPU": 1.0}},
                    "bundles_to_node_id": {0: "id2", 1: "id3"}},
              "c": {"name": "gone", "state": "REMOVED", "bundles": {0: {"GPU": 2.0}}, "bundles_to_node_id": {0: "id1"}}}
    ray = FakeRay(groups=groups)
    assert describe_node(ray, 1) == "node 1 (127.0.0.3): 0 of 2 GPUs free, held by hacrl-qwen3-engines-1a2b (2 GPUs)"
    assert describe_node(ray, 0) == "node 0 (127.0.0.2): 2 of 2 GPUs free, held by no placement group"
    assert describe_node(ray, 7) == "node 7: no live Ray node carries hacrl_node_7 (lost, or not started)"


def _exp(tmp_path, tps=(1, 2), gpus=((0, 1), (6, 7))):
    exp = tiny_exp(tmp_path, backend="megatron")
    agents = [dataclasses.replace(a, workers="ray", rollout_gpu_ids=list(g),
                                  parallel=dataclasses.replace(a.parallel, tp=tp))
              for a, tp, g in zip(exp.agents, tps, gpus)]
    rollout = dataclasses.replace(exp.rollout, engine="sglang", weight_sync="distributed",
                                  sglang=dataclasses.replace(exp.rollout.sglang, placement="ray", tp=2))
    return validate(dataclasses.replace(exp, agents=agents, rollout=rollout))


def test_trainer_spans_follow_the_plan_across_nodes(tmp_path, monkeypatch):
    """4 nodes × 2 GPUs: llama (1 rank) on node 1 GPU 0, qwen3 (TP2) on node 1 GPU 1 and node 2 GPU 0:
    a TP group over two nodes; engines (TP2) on node 0 and node 3."""
    from hacrl_megatron.agents import ray_placement
    from hacrl_megatron.trainer.runtime import planned_trainer_spans

    exp = _exp(tmp_path)
    monkeypatch.setattr(ray_placement, "ensure_ray", lambda *a, **k: FakeRay())
    monkeypatch.setenv("HACRL_GPUS_PER_NODE", "2")
    assert planned_trainer_spans(exp, exp.agents[0]) == [(1, 1)]
    assert planned_trainer_spans(exp, exp.agents[1]) == [(1, 1), (2, 1)]
    bundles = pinned_bundles(exp.agents[1], {"CPU": 1.0, "GPU": 1.0}, [(1, 1), (2, 1)])
    assert bundles == [{"CPU": 1.0, "GPU": 1.0, "hacrl_node_1": 1.0}, {"CPU": 1.0, "GPU": 1.0, "hacrl_node_2": 1.0}]
    with pytest.raises(RayAgentError, match=r"planned spans \[\(1, 1\)\] hold 1 ranks"):
        pinned_bundles(exp.agents[1], {"CPU": 1.0}, [(1, 1)])
    monkeypatch.delenv("HACRL_GPUS_PER_NODE")
    with pytest.raises(ValueError, match=r"agent 'llama': .*HACRL_GPUS_PER_NODE is unset"):
        planned_trainer_spans(exp, exp.agents[0])
    monkeypatch.setattr(ray_placement, "ensure_ray", lambda *a, **k: FakeRay(nodes=1))
    assert planned_trainer_spans(exp, exp.agents[0]) is None  # one node: Ray places the ranks


def test_a_plan_that_does_not_fit_the_job_is_refused_naming_the_agent(tmp_path, monkeypatch):
    from hacrl_megatron.agents import ray_placement
    from hacrl_megatron.launch.placement import PlacementError
    from hacrl_megatron.trainer.runtime import planned_trainer_spans

    exp = _exp(tmp_path, gpus=((0, 1), (2, 3)))  # qwen3's engine on node 1, where the trainers are
    monkeypatch.setattr(ray_placement, "ensure_ray", lambda *a, **k: FakeRay())
    monkeypatch.setenv("HACRL_GPUS_PER_NODE", "2")
    with pytest.raises(PlacementError, match=r"agent 'qwen3': engine on node 1 GPUs \[0, 1\] overlaps the trainer ranks "
                                             r"of agent 'llama'"):
        planned_trainer_spans(exp, exp.agents[0])
