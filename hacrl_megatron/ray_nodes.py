"""The nodes of a launched job as Ray sees them: which node is which, and who holds a node's GPUs.

Every node of a ``hacrl launch`` job carries a Ray resource named after its Slurm node index,
``hacrl_node_<k>`` (launch/slurm_ray.py's script), and the script exports the GPUs per node as
``$HACRL_GPUS_PER_NODE``. With both, a trainer rank or an engine the planner put on node k asks for
that node's resource and lands there (agents/ray_placement.py, rollout/engine_actor.py). A cluster
whose nodes carry the resource follows a plan; without ``$HACRL_GPUS_PER_NODE`` it cannot map the
plan's job-wide GPU indices to nodes, which is an error rather than a silent fallback to "anywhere".

A leaf module (standard library only; the ``ray`` module is passed in).
"""

from __future__ import annotations

import os
import re
from typing import Any

NODE_RESOURCE = "hacrl_node_{}"  # the Ray resource every node of a launched job carries, by Slurm node index
GPUS_PER_NODE_ENV = "HACRL_GPUS_PER_NODE"  # exported by hacrl launch's Slurm script
PLACEMENT_TIMEOUT_ENV = "HACRL_PLACEMENT_TIMEOUT_S"  # how long a placement group may wait for its bundles
PLACEMENT_TIMEOUT_S = 300.0
_NODE = re.compile(r"hacrl_node_(\d+)")


class PlacementTimeout(RuntimeError):
    """A planned placement the cluster did not satisfy in time (one line: agent, node, who holds it)."""


def job_nodes(ray: Any) -> list[int]:
    """The Slurm node indices whose ``hacrl_node_<k>`` resource the cluster offers (sorted; empty for
    a cluster that was not launched by ``hacrl launch``)."""
    return sorted(int(m.group(1)) for key in ray.cluster_resources() if (m := _NODE.fullmatch(key)))


def gpus_per_node_setting(who: str) -> int | None:
    """``$HACRL_GPUS_PER_NODE`` as a positive int, or None when unset; a bad value raises ValueError
    naming ``who`` and the variable. Whether an unset value is allowed is the caller's to say."""
    raw = os.environ.get(GPUS_PER_NODE_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{who}: ${GPUS_PER_NODE_ENV}={raw!r}: must be a positive GPU count per node")
    return value


def gpus_per_node(ray: Any, who: str) -> int | None:
    """``$HACRL_GPUS_PER_NODE`` as a positive int; None on a cluster without per-node resources (one
    host, a plain Ray cluster) and on one without GPUs (a CPU job: the plan places GPUs, so there is
    nothing to map and Ray places CPU ranks and engines). Raises ValueError naming ``who`` and the
    variable when a GPU cluster carries them (a launched multi-node job follows its plan) and the
    variable is unset or bad."""
    value = gpus_per_node_setting(who)
    nodes = job_nodes(ray)
    if value is None and len(nodes) > 1 and float(ray.cluster_resources().get("GPU", 0.0)) > 0:
        raise ValueError(f"{who}: this Ray cluster's {len(nodes)} nodes carry hacrl_node_<k> resources (a hacrl "
                         f"launch job following its plan) but ${GPUS_PER_NODE_ENV} is unset: set it to the GPUs "
                         "per node the plan was made for")
    return value


def placement_timeout() -> float:
    """Seconds a planned placement group may wait for its bundles (``$HACRL_PLACEMENT_TIMEOUT_S``, default 300)."""
    raw = os.environ.get(PLACEMENT_TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else PLACEMENT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"${PLACEMENT_TIMEOUT_ENV}={raw!r}: must be a positive number of seconds")
    return value


def describe_node(ray: Any, node: int) -> str:
    """``node 1 (127.0.0.3): 0 of 2 GPUs free, held by hacrl-qwen3-engines-1a2b (2 GPUs)``: the node
    with resource ``hacrl_node_<node>``, its GPUs and the placement groups whose bundles hold them."""
    name = NODE_RESOURCE.format(node)
    live = [n for n in ray.nodes() if n.get("Alive") and name in n.get("Resources", {})]
    if not live:
        return f"node {node}: no live Ray node carries {name} (lost, or not started)"
    info = live[0]
    node_id, total = info["NodeID"], float(info["Resources"].get("GPU", 0.0))
    holders: dict[str, float] = {}
    for group in ray.util.placement_group_table().values():
        if group.get("state") != "CREATED":
            continue
        gpus = sum(float(group["bundles"][b].get("GPU", 0.0))
                   for b, where in group.get("bundles_to_node_id", {}).items() if where == node_id)
        if gpus:
            label = group.get("name") or f"unnamed placement group {group.get('placement_group_id', '?')[:8]}"
            holders[label] = holders.get(label, 0.0) + gpus
    free = total - sum(holders.values())
    held = ", ".join(f"{k} ({v:g} GPUs)" for k, v in sorted(holders.items())) or "no placement group"
    return f"node {node} ({info.get('NodeManagerAddress', '?')}): {free:g} of {total:g} GPUs free, held by {held}"
