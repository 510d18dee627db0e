"""Which nodes of a Slurm job each agent's ranks and engines use, from the experiment config.

The controller (``hacrl train``) runs on the first node of the job, and our SGLang servers are its
subprocesses, so every agent's engines sit on that node at their ``rollout_gpu_ids``. With more
than one node and SGLang engines, the first node gives Ray no GPUs (``ray start --num-gpus=0``):
the trainers' Ray worker groups then land on nodes 1..N-1. Each agent's ``tp·pp·dp`` ranks take
consecutive GPUs, agents in config order; an agent whose world is a multiple of the node size
gets whole nodes, and a TP group never straddles two nodes when the node size is a multiple of
TP (ranks are node-contiguous, :mod:`hacrl_megatron.agents.ray_placement`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hacrl_megatron.config import ExperimentConfig


class PlacementError(ValueError):
    """The job's nodes cannot host the config's agents (message names the agent and the numbers)."""


@dataclass(frozen=True)
class AgentNodes:
    """One agent's GPUs: trainer ranks as (node, first GPU, count) spans, engines on the first node."""

    name: str
    tp: int
    world: int
    spans: tuple[tuple[int, int, int], ...]  # (node, first local GPU, GPUs) in rank order
    engine_gpus: tuple[int, ...]  # GPU ids on node 0

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(node for node, _, _ in self.spans)

    def whole_nodes(self, gpus_per_node: int) -> bool:
        """Each node it uses holds only this agent's ranks, all of its GPUs."""
        return all(first == 0 and count == gpus_per_node for _, first, count in self.spans)

    def tp_groups_within_nodes(self) -> bool:
        """Every TP group (``tp`` consecutive ranks) sits on one node."""
        return all(count % self.tp == 0 for _, _, count in self.spans)


@dataclass(frozen=True)
class NodePlan:
    nodes: int
    gpus_per_node: int
    head_ray_gpus: int | None  # None: Ray sees all of the head node's GPUs
    agents: tuple[AgentNodes, ...]

    def describe(self) -> list[str]:
        """One line per agent, for the launch script's header."""
        lines = []
        for a in self.agents:
            spans = ", ".join(f"node {n} GPUs {f}-{f + c - 1}" for n, f, c in a.spans)
            engines = f"; engines on node 0 GPUs {list(a.engine_gpus)}" if a.engine_gpus else ""
            kind = "whole nodes" if a.whole_nodes(self.gpus_per_node) else "shares a node"
            lines.append(f"{a.name}: {a.world} ranks (tp={a.tp}) on {spans} ({kind}){engines}")
        if self.head_ray_gpus == 0:
            lines.append("node 0: controller + SGLang engines; its GPUs are withheld from Ray (--num-gpus=0)")
        return lines


def node_plan(cfg: ExperimentConfig, nodes: int, gpus_per_node: int) -> NodePlan:
    """The expected placement of ``cfg`` on ``nodes`` × ``gpus_per_node`` GPUs (module docstring);
    raises :class:`PlacementError` when the trainers or engines do not fit."""
    if nodes < 1 or gpus_per_node < 1:
        raise PlacementError(f"nodes={nodes}, gpus_per_node={gpus_per_node}: both must be >= 1")
    engines_on_head = cfg.rollout.engine == "sglang" and nodes > 1
    first_node = 1 if engines_on_head else 0
    free = (nodes - first_node) * gpus_per_node
    need = sum(a.parallel.world_size for a in cfg.agents)
    if need > free:
        raise PlacementError(f"the agents' trainers need {need} GPUs, the job has {free} for them ({nodes} node(s) "
                             f"× {gpus_per_node}{', node 0 for engines' if engines_on_head else ''})")
    cursor = first_node * gpus_per_node
    agents, engine_owner = [], {}
    for a in cfg.agents:
        for gpu in a.rollout_gpu_ids:
            if gpu >= gpus_per_node:
                raise PlacementError(f"agent {a.name!r}: rollout_gpu_ids has GPU {gpu}, a node has {gpus_per_node}")
            if engines_on_head and engine_owner.setdefault(gpu, a.name) != a.name:
                raise PlacementError(f"agent {a.name!r}: engine GPU {gpu} of node 0 is agent "
                                     f"{engine_owner[gpu]!r}'s too (engines are not colocated across nodes)")
        world = a.parallel.world_size
        spans, left = [], world
        while left:
            node, first = divmod(cursor, gpus_per_node)
            take = min(left, gpus_per_node - first)
            spans.append((node, first, take))
            cursor, left = cursor + take, left - take
        agents.append(AgentNodes(a.name, a.parallel.tp, world, tuple(spans), tuple(a.rollout_gpu_ids)))
    return NodePlan(nodes, gpus_per_node, 0 if engines_on_head else None, tuple(agents))
