"""Which GPUs of a job each agent's trainer ranks and rollout engines use: one rule for the planner
(``hacrl plan`` decides the counts) and the launcher (``hacrl launch`` prints where they go).

The controller (``hacrl train``) runs on node 0, the Ray head, and needs no GPU; every node offers
all of its GPUs to Ray. The rule, for ``nodes`` × ``gpus_per_node`` GPUs:

* **trainers**: each agent's ``tp·pp·dp`` ranks take consecutive GPUs, agents in config order,
  starting on node 1 when the other nodes hold every trainer (else on node 0); an agent whose
  world is a multiple of the node size gets whole nodes, and a TP group never straddles two nodes
  when the node size is a multiple of TP (Ray worker groups are node-contiguous,
  :mod:`hacrl_megatron.agents.ray_placement`);
* **engines**: whole engines of ``rollout.sglang.tp`` GPUs, never split across nodes, on the GPUs
  the trainers leave free; each agent's engines go first to nodes holding no trainer that are not
  the controller's, then to the controller's node, then to other agents' trainer nodes, then to
  its own (ascending node index within each group).

On one node the engines sit on the ``rollout_gpu_ids`` the config lists: when the trainers fit on
the other GPUs, Ray is offered only those (the engines' GPUs are reserved); otherwise the engines
share the trainers' GPUs (``rollout.colocate``, or resident engines at their ``mem_fraction``). On
several nodes ``agents.N.rollout_gpu_ids`` are job-wide GPU indices, ``node · gpus_per_node +
local id`` (on node 0 the same as local ids): ``len / tp`` engines at those places.

Colocated servers placed by Ray (``rollout.colocate`` with ``rollout.sglang.placement: ray``, any
number of nodes) follow the trainers instead: every node's engines are ``rollout.sglang.tp`` GPUs of
that node's trainer ranks (:func:`colocated_engines`; the runtime reads the ranks' real GPUs,
rollout/engine_actor.colocated_shares). Local servers start on the controller's node only, so
colocation with ``placement: local`` stays on one node.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hacrl_megatron.config import ExperimentConfig

Span = tuple[int, int, int]  # (node, first local GPU, GPUs)


class PlacementError(ValueError):
    """The job's nodes cannot host the config's agents (message names the agent and the numbers)."""


@dataclass(frozen=True)
class Engine:
    """One rollout engine: ``gpus`` consecutive GPUs of one node from local GPU ``first``."""

    node: int
    first: int
    gpus: int

    def job_ids(self, gpus_per_node: int) -> list[int]:
        """The engine's GPUs as job-wide indices (``node · gpus_per_node + local id``)."""
        return [self.node * gpus_per_node + self.first + g for g in range(self.gpus)]


@dataclass(frozen=True)
class AgentNodes:
    """One agent's GPUs: trainer ranks as (node, first GPU, count) spans in rank order, and engines."""

    name: str
    tp: int
    world: int
    spans: tuple[Span, ...]
    engines: tuple[Engine, ...] = ()

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(node for node, _, _ in self.spans)

    @property
    def engine_nodes(self) -> tuple[int, ...]:
        return tuple(sorted({e.node for e in self.engines}))

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
    head_gpu_ids: tuple[int, ...] | None  # GPUs node 0 offers Ray; None: all of them
    agents: tuple[AgentNodes, ...]
    shared: bool = False  # the engines share the trainers' GPUs (one node, or servers following the Ray ranks)

    def describe(self) -> list[str]:
        """One line per agent (and one for node 0), for the launch script's header."""
        lines = []
        for a in self.agents:
            spans = ", ".join(f"node {n} GPUs {f}-{f + c - 1}" for n, f, c in a.spans)
            kind = "whole nodes" if a.whole_nodes(self.gpus_per_node) else "shares a node"
            lines.append(f"{a.name}: {a.world} ranks (tp={a.tp}) on {spans} ({kind}){_engines_text(a, self)}")
        offered = "all of its GPUs" if self.head_gpu_ids is None else f"GPUs {list(self.head_gpu_ids)}"
        lines.append(f"node 0: the controller (no GPU); Ray is offered {offered}")
        return lines


def _engines_text(a: AgentNodes, plan: NodePlan) -> str:
    if not a.engines:
        return "; engine colocated on its trainer GPUs" if plan.shared else ""
    by_node: dict[int, list[int]] = {}
    for e in a.engines:
        by_node.setdefault(e.node, []).extend(range(e.first, e.first + e.gpus))
    where = ", ".join(f"node {n} GPUs {ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1))
                      else f"node {n} GPUs {ids}" for n, ids in sorted(by_node.items()))
    shared = " (sharing the trainers' GPUs)" if plan.shared else ""
    return f"; {len(a.engines)} engine(s) x {a.engines[0].gpus} GPUs on {where}{shared}"


# --------------------------------------------------------------------------------------------
# the rule


def trainer_start_node(trainer_gpus: list[int], nodes: int, gpus_per_node: int) -> int:
    """Node 1 when the nodes after the controller's hold every trainer rank, else node 0."""
    return 1 if nodes > 1 and sum(trainer_gpus) <= (nodes - 1) * gpus_per_node else 0


def place_trainers(trainer_gpus: list[int], nodes: int, gpus_per_node: int,
                   skip: frozenset[tuple[int, int]] = frozenset()) -> list[tuple[Span, ...]]:
    """Each agent's trainer spans: consecutive free GPUs from :func:`trainer_start_node`, skipping the
    (node, local GPU) pairs in ``skip`` (one node's reserved engine GPUs)."""
    start = trainer_start_node(trainer_gpus, nodes, gpus_per_node)
    free = [(n, g) for n in range(start, nodes) for g in range(gpus_per_node) if (n, g) not in skip]
    if sum(trainer_gpus) > len(free):
        raise PlacementError(f"the agents' trainers need {sum(trainer_gpus)} GPUs, the job has {len(free)} for them "
                             f"({nodes} node(s) × {gpus_per_node}{', minus reserved engine GPUs' if skip else ''})")
    out, cursor = [], 0
    for count in trainer_gpus:
        gpus, cursor = free[cursor:cursor + count], cursor + count
        spans: list[list[int]] = []
        for node, g in gpus:
            if spans and spans[-1][0] == node and spans[-1][1] + spans[-1][2] == g:
                spans[-1][2] += 1
            else:
                spans.append([node, g, 1])
        out.append(tuple((n, f, c) for n, f, c in spans))
    return out


def free_gpus(trainers: list[tuple[Span, ...]], nodes: int, gpus_per_node: int) -> dict[int, list[int]]:
    """Local GPU ids no trainer uses, per node."""
    used = {(n, f + i) for spans in trainers for n, f, c in spans for i in range(c)}
    return {n: [g for g in range(gpus_per_node) if (n, g) not in used] for n in range(nodes)}


def engine_slots(free: dict[int, list[int]], engine_tp: int) -> int:
    """Whole engines the free GPUs hold (consecutive runs of ``engine_tp`` GPUs of one node)."""
    return sum(len(_runs(ids, engine_tp)) for ids in free.values())


def _runs(ids: list[int], tp: int) -> list[int]:
    """First GPUs of the whole ``tp``-GPU engines that consecutive runs of ``ids`` hold."""
    firsts, run = [], []
    for g in ids + [None]:
        if g is not None and run and g == run[-1] + 1:
            run.append(g)
            continue
        firsts += [run[k] for k in range(0, len(run) - tp + 1, tp)]
        run = [] if g is None else [g]
    return firsts


def split_engines(costs: list[float], slots: int) -> list[int]:
    """Engines per agent in proportion to each agent's rollout cost, at least one each, ``slots`` in
    all (largest remainder; ties to the earlier agent)."""
    n = len(costs)
    if slots < n:
        raise PlacementError(f"{slots} whole engine(s) fit on the free GPUs; {n} agents need one each at least")
    ideal = [c / sum(costs) * slots for c in costs]
    counts = [max(1, math.floor(x)) for x in ideal]
    while sum(counts) > slots:  # the floors of 1 overshot: take from the agents furthest above their share
        over = [i for i in range(n) if counts[i] > 1]
        counts[max(over, key=lambda i: (counts[i] - ideal[i], -i))] -= 1
    while sum(counts) < slots:
        counts[max(range(n), key=lambda i: (ideal[i] - counts[i], -i))] += 1
    return counts


def place_engines(counts: list[int], engine_tp: int, trainers: list[tuple[Span, ...]], nodes: int,
                  gpus_per_node: int, controller: int = 0) -> list[tuple[Engine, ...]]:
    """Each agent's ``counts[i]`` engines on the free GPUs, in the module docstring's node order."""
    free = free_gpus(trainers, nodes, gpus_per_node)
    trainer_nodes = [{n for n, _, _ in spans} for spans in trainers]
    anyone = set().union(*trainer_nodes) if trainer_nodes else set()
    out = []
    for i, count in enumerate(counts):
        def rank(node: int, own: set[int] = trainer_nodes[i]) -> tuple[int, int]:
            group = 3 if node in own else 2 if node in anyone else 1 if node == controller else 0
            return group, node

        engines: list[Engine] = []
        for node in sorted(free, key=rank):
            for first in _runs(free[node], engine_tp):
                if len(engines) == count:
                    break
                engines.append(Engine(node, first, engine_tp))
                free[node] = [g for g in free[node] if not first <= g < first + engine_tp]
        if len(engines) < count:
            raise PlacementError(f"agent {i}: {count} engine(s) of {engine_tp} GPUs do not fit the free GPUs")
        out.append(tuple(engines))
    return out


# --------------------------------------------------------------------------------------------
# a config's placement


def colocated_engines(cfg: ExperimentConfig, trainers: list[tuple[Span, ...]]) -> list[tuple[Engine, ...]]:
    """Each agent's colocated servers placed by Ray (rollout/engine_actor.colocated_shares): on every node
    of its trainer spans, ``rollout.sglang.tp`` of that node's trainer GPUs per server."""
    tp = cfg.rollout.sglang.tp
    out = []
    for a, spans in zip(cfg.agents, trainers):
        for node, _, count in spans:
            if count % tp:
                raise PlacementError(f"rollout.sglang.tp={tp}: agent {a.name!r} has {count} trainer GPU(s) on node "
                                     f"{node}; colocated servers of {tp} GPUs each must tile every node's share")
        out.append(tuple(Engine(node, first + k, tp) for node, first, count in spans for k in range(0, count, tp)))
    return out


def _config_engines(cfg: ExperimentConfig, nodes: int, gpus_per_node: int) -> list[tuple[Engine, ...]]:
    """Each agent's engines from ``rollout_gpu_ids`` (job-wide indices; groups of ``rollout.sglang.tp``)."""
    tp = cfg.rollout.sglang.tp
    owner: dict[int, str] = {}
    out = []
    for a in cfg.agents:
        engines = []
        for k in range(0, len(a.rollout_gpu_ids), tp):
            group = a.rollout_gpu_ids[k:k + tp]
            for gpu in group:
                if gpu >= nodes * gpus_per_node:
                    raise PlacementError(f"agent {a.name!r}: rollout_gpu_ids has GPU {gpu}, the job has "
                                         f"{nodes * gpus_per_node} ({nodes} node(s) × {gpus_per_node})")
                if owner.setdefault(gpu, a.name) != a.name:
                    raise PlacementError(f"agent {a.name!r}: engine GPU {gpu} is agent {owner[gpu]!r}'s too")
            node, first = divmod(group[0], gpus_per_node)
            if group != list(range(group[0], group[0] + tp)) or first + tp > gpus_per_node:
                raise PlacementError(f"agent {a.name!r}: engine GPUs {group} are not {tp} consecutive GPUs of one "
                                     f"node (an engine never spans nodes; job-wide index = node × {gpus_per_node} "
                                     "+ local id)")
            engines.append(Engine(node, first, tp))
        out.append(tuple(engines))
    return out


def job_config(cfg: ExperimentConfig, agent: str) -> ExperimentConfig:
    """``cfg`` as the job of its agent ``agent`` alone sees it for placement (``hacrl train --agent``: the
    job's nodes and GPUs hold that agent's trainer and engines only)."""
    found = [a for a in cfg.agents if a.name == agent]
    if not found:
        raise PlacementError(f"--agent {agent!r}: no such agent in this config; its agents are "
                             f"{[a.name for a in cfg.agents]}")
    return dataclasses.replace(cfg, agents=found)


def fewest_nodes(cfg: ExperimentConfig, most: int, gpus_per_node: int) -> int:
    """The fewest nodes (≤ ``most``) ``cfg`` fits on with ``gpus_per_node`` GPUs each; raises the
    :class:`PlacementError` of ``most`` nodes when it fits on none."""
    for nodes in range(1, most):
        try:
            node_plan(cfg, nodes, gpus_per_node)
            return nodes
        except PlacementError:
            continue
    node_plan(cfg, most, gpus_per_node)
    return most


def node_plan(cfg: ExperimentConfig, nodes: int, gpus_per_node: int) -> NodePlan:
    """The expected placement of ``cfg`` on ``nodes`` × ``gpus_per_node`` GPUs (module docstring);
    raises :class:`PlacementError` when the trainers or engines do not fit or overlap."""
    if nodes < 1 or gpus_per_node < 1:
        raise PlacementError(f"nodes={nodes}, gpus_per_node={gpus_per_node}: both must be >= 1")
    sglang = cfg.rollout.engine == "sglang"
    worlds = [a.parallel.world_size for a in cfg.agents]
    engines = _config_engines(cfg, nodes, gpus_per_node) if sglang else [()] * len(worlds)
    head, shared = None, False
    follow_ranks = sglang and cfg.rollout.colocate and cfg.rollout.sglang.placement == "ray"
    if cfg.rollout.colocate and nodes > 1 and cfg.rollout.engine == "vllm":
        raise PlacementError(f"rollout.engine=vllm with rollout.colocate=true on {nodes} nodes: vLLM servers start on "
                             "the controller's node only, the trainer ranks they would share GPUs with run on the "
                             "others: colocate on one node, or use rollout.engine=sglang with "
                             "rollout.sglang.placement=ray")
    if follow_ranks:  # colocated servers placed by Ray: on every node, that node's trainer GPUs
        trainers = place_trainers(worlds, nodes, gpus_per_node)
        engines, shared = colocated_engines(cfg, trainers), True
    elif nodes == 1:
        # one node: engine GPUs are withheld from Ray when the trainers fit on the others
        reserved = frozenset((0, g) for e in engines for x in e for g in range(x.first, x.first + x.gpus))
        shared = sglang and (cfg.rollout.colocate or sum(worlds) > gpus_per_node - len(reserved))
        trainers = place_trainers(worlds, 1, gpus_per_node, skip=frozenset() if shared else reserved)
        if reserved and not shared:
            head = tuple(g for g in range(gpus_per_node) if (0, g) not in reserved)
    elif sglang and cfg.rollout.colocate:
        raise PlacementError(f"rollout.sglang.placement=local with rollout.colocate=true on {nodes} nodes: local "
                             "servers start on the controller's node, the trainer ranks they would share GPUs with "
                             "run on the others: set rollout.sglang.placement=ray (the servers then follow each "
                             "agent's Ray ranks onto their nodes; weights by rollout.weight_sync=disk)")
    else:
        trainers = place_trainers(worlds, nodes, gpus_per_node)
        if sglang and not any(engines):
            # no engine GPUs given: one engine per agent where the rule puts it
            engines = place_engines([1] * len(worlds), cfg.rollout.sglang.tp, trainers, nodes, gpus_per_node)
        used = {(n, f + i): cfg.agents[k].name for k, spans in enumerate(trainers) for n, f, c in spans
                for i in range(c)}
        for a, agent_engines in zip(cfg.agents, engines):
            for e in agent_engines:
                clash = [g for g in range(e.first, e.first + e.gpus) if (e.node, g) in used]
                if clash:
                    raise PlacementError(f"agent {a.name!r}: engine on node {e.node} GPUs {clash} overlaps the "
                                         f"trainer ranks of agent {used[(e.node, clash[0])]!r} (trainers fill "
                                         f"nodes {trainer_start_node(worlds, nodes, gpus_per_node)}.. in config "
                                         "order; hacrl plan places both)")
    agents = tuple(AgentNodes(a.name, a.parallel.tp, w, spans, e)
                   for a, w, spans, e in zip(cfg.agents, worlds, trainers, engines))
    return NodePlan(nodes, gpus_per_node, head, agents, shared=shared)
