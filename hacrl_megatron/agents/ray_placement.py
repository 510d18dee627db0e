"""Where a :class:`~hacrl_megatron.agents.ray_agent.RayAgent`'s ranks run: Ray, placement groups, rank order.

One agent is one Megatron world (docs/architecture.md): the agent's ``tp*pp*cp*dp`` ranks are Ray
actors in one placement group, one bundle per rank (1 CPU, plus 1 GPU on GPU clusters);
STRICT_PACK when the group fits one node so that TP stays on NVLink, else PACK. Ranks of one node are numbered
contiguously so that TP groups stay intra-node, and every rank gets the ``torch.distributed``
environment of its world (:func:`rank_envs`).

Ray is imported lazily (:func:`require_ray`): the package works without it until an agent asks
for Ray workers.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import uuid
from pathlib import Path
from typing import Any

from hacrl_megatron.config import AgentConfig
from hacrl_megatron.models.parallel import LOOPBACK, cuda_rank_env
from hacrl_megatron.ray_nodes import NODE_RESOURCE, describe_node, job_nodes

logger = logging.getLogger(__name__)
INSTALL_HINT = "pip install ray  (or the package's launch extra: pip install 'hacrl_megatron[launch]')"


class RayAgentError(RuntimeError):
    """The agent's Ray world cannot be placed, or one of its ranks failed (message names agent and rank)."""


class TrainerNodeLost(RayAgentError):
    """A node holding some of the agent's ranks left the cluster: the run stops (its Megatron world
    cannot continue without the rank) and resumes from its last checkpoint (message names agent and node)."""


def node_left(ray: Any, ip: str) -> bool:
    """No live Ray node has address ``ip`` any more (False when the cluster cannot be asked)."""
    try:
        return not any(n.get("Alive") and n.get("NodeManagerAddress") == ip for n in ray.nodes())
    except Exception:  # noqa: BLE001 - no answer is no evidence of a lost node
        return False


def require_ray() -> Any:
    """The ``ray`` module, or an ImportError that says what to install."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(f"RayAgent needs Ray, which is not installed: {INSTALL_HINT}") from err
    return ray


def ensure_ray(address: str | None = None, **init_kwargs: Any) -> Any:
    """``ray.init`` once per process: joins ``address`` / ``$RAY_ADDRESS`` / a local ``ray start``
    cluster when one exists, else starts a private one bound to loopback. Returns the ``ray`` module.

    A private cluster serves this machine only, so its services (GCS, raylet, object manager,
    workers) listen on 127.0.0.1, not on every interface as Ray's default node address would have
    them. Clusters that are joined keep their own addresses: multi-node clusters rely on a private
    cluster network (docs/security.md, "In short").
    """
    ray = require_ray()
    if not ray.is_initialized():
        init_kwargs.setdefault("include_dashboard", False)
        init_kwargs.setdefault("log_to_driver", True)
        if _starts_private_cluster(address):
            _node_address_on_loopback()
            from hacrl_megatron.sockets import ray_temp_dir

            if ray_temp_dir() is not None:  # a long TMPDIR: Ray's socket paths would pass AF_UNIX's limit
                init_kwargs.setdefault("_temp_dir", ray_temp_dir())
        ray.init(address=address, **init_kwargs)
    return ray


def _starts_private_cluster(address: str | None) -> bool:
    """True when ``ray.init(address)`` would start a new local cluster rather than join one."""
    from ray._private.services import canonicalize_bootstrap_address

    return canonicalize_bootstrap_address(address) is None


def _node_address_on_loopback() -> None:
    """Make the next private cluster's node address 127.0.0.1. Ray (2.x) resolves a loopback
    ``_node_ip_address`` to the machine's network address unless its single-machine mode (the
    macOS/Windows default) is on; the switch is an environment variable, read at import by this
    process (hence also set on the imported module) and by the cluster's processes it starts."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def describe(agent_cfg: AgentConfig) -> str:
    """``agent 'a' (tp=2, pp=1, dp=1: 2 ranks)`` (``cp=`` too when it is > 1), for error messages."""
    p = agent_cfg.parallel
    cp = f", cp={p.cp}" if p.cp > 1 else ""
    return f"agent {agent_cfg.name!r} (tp={p.tp}, pp={p.pp}{cp}, dp={p.dp}: {p.world_size} ranks)"


def rank_bundle(use_gpu: bool, cpus_per_rank: int) -> dict[str, float]:
    """The resources of one rank's bundle."""
    return {"CPU": float(cpus_per_rank), **({"GPU": 1.0} if use_gpu else {})}


def check_cluster(ray: Any, agent_cfg: AgentConfig, bundle: dict[str, float]) -> str:
    """Raise when the whole cluster is too small; return the placement strategy to use."""
    world = agent_cfg.parallel.world_size
    total = ray.cluster_resources()
    have = {k: float(total.get(k, 0.0)) for k in bundle}
    need = {k: v * world for k, v in bundle.items()}
    short = {k: (need[k], have[k]) for k in bundle if have[k] < need[k]}
    if short:
        parts = ", ".join(f"{k}: needs {n:g}, cluster has {h:g}" for k, (n, h) in short.items())
        raise RayAgentError(f"{describe(agent_cfg)} needs one bundle {bundle} per rank; {parts}. "
                            "Add nodes/resources to the Ray cluster or shrink the layout")
    fits_one = any(all(float(n.get("Resources", {}).get(k, 0.0)) >= need[k] for k in bundle)
                   for n in ray.nodes() if n.get("Alive", False))
    return "STRICT_PACK" if fits_one else "PACK"


def pinned_bundles(agent_cfg: AgentConfig, bundle: dict[str, float],
                   node_spans: list[tuple[int, int]]) -> list[dict[str, float]]:
    """One ``bundle`` per rank, each asking for its planned node's ``hacrl_node_<k>`` resource:
    ``node_spans`` lists (node, ranks) in rank order, as the plan lays the trainer out (an agent
    spanning nodes gets one run of bundles per node)."""
    if sum(count for _, count in node_spans) != agent_cfg.parallel.world_size:
        raise RayAgentError(f"{describe(agent_cfg)}: planned spans {node_spans} hold "
                            f"{sum(c for _, c in node_spans)} ranks")
    return [{**bundle, NODE_RESOURCE.format(node): 1.0} for node, count in node_spans for _ in range(count)]


def reserve(ray: Any, agent_cfg: AgentConfig, bundle: dict[str, float], timeout_s: float,
            node_spans: list[tuple[int, int]] | None = None) -> Any:
    """A ready placement group of one ``bundle`` per rank, on the planned nodes when ``node_spans``
    ((node, ranks) in rank order) is given; raises :class:`RayAgentError` (after releasing it) when
    the cluster does not free the bundles within ``timeout_s``, naming the planned nodes and what
    holds their GPUs."""
    from ray.util.placement_group import placement_group

    world = agent_cfg.parallel.world_size
    if node_spans:
        missing = sorted({n for n, _ in node_spans} - set(job_nodes(ray)))
        if missing:
            raise RayAgentError(f"{describe(agent_cfg)}: trainer planned on node {missing[0]}: the Ray cluster has no "
                                f"node with resource {NODE_RESOURCE.format(missing[0])!r}")
        bundles = pinned_bundles(agent_cfg, bundle, node_spans)
        strategy = "STRICT_PACK" if len(node_spans) == 1 else "PACK"
    else:
        strategy = check_cluster(ray, agent_cfg, bundle)
        bundles = [dict(bundle)] * world
    pg = placement_group(bundles, strategy=strategy, name=f"hacrl-{agent_cfg.name}-{uuid.uuid4().hex[:8]}")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        release(pg)
        if node_spans:
            where = "; ".join(describe_node(ray, n) for n in dict(node_spans))
            raise RayAgentError(f"agent {agent_cfg.name!r}: trainer ranks planned on "
                                f"{', '.join(f'node {n} ({c})' for n, c in node_spans)} not placed within "
                                f"{timeout_s:g} s: {where}")
        raise RayAgentError(
            f"{describe(agent_cfg)}: placement group of {world} bundles {bundle} ({strategy}) not ready "
            f"after {timeout_s:g} s; free now: {ray.available_resources()} (other agents may hold the rest)")
    return pg


def release(pg: Any) -> None:
    """Give a placement group's bundles back to the cluster. A close path: a failure (the cluster
    already gone) is logged, not raised."""
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception as err:  # noqa: BLE001 - the caller's other resources must still be closed
        logger.warning("could not remove placement group %s: %s: %s", getattr(pg, "id", pg), type(err).__name__, err)


def spawn_actors(actor_cls: Any, pg: Any, bundle: dict[str, float], world: int, env_vars: dict[str, str],
                 *init_args: Any) -> list[Any]:
    """One ``actor_cls`` actor per bundle of ``pg`` (``world`` bundles), in bundle order.

    Actors import hacrl_megatron from where this process does (an uninstalled checkout works
    too); ``env_vars`` are added to every actor's environment (e.g. NCCL_DEBUG, GLOO_SOCKET_IFNAME),
    after the Megatron rank defaults of GPU bundles (``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless this
    process or ``env_vars`` set another value: ``models.parallel.CUDA_RANK_ENV``).
    """
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    rank_env = cuda_rank_env() if bundle.get("GPU", 0) else {}
    runtime_env: dict[str, Any] = {"env_vars": {"PYTHONPATH": path, **rank_env, **env_vars}}
    if shlex.quote(sys.executable) != sys.executable:
        # Ray (2.60) starts a worker that has a runtime_env through `bash -c "exec <python> ..."`
        # without quoting the interpreter: a venv under a path with a space never starts a worker.
        # `py_executable` is spliced into that command as given, so the quoted path goes there
        # (the same interpreter path on every node, as with a shared-filesystem venv).
        runtime_env["py_executable"] = shlex.quote(sys.executable)
    return [
        actor_cls.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), runtime_env=runtime_env,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              placement_group=pg, placement_group_bundle_index=b)).remote(*init_args)
        for b in range(world)
    ]


def rank_order(infos: list[dict[str, Any]]) -> list[int]:
    """Bundle indices in rank order: ranks of one node are contiguous (TP groups stay intra-node),
    nodes in the order of their first bundle, bundles in index order within a node."""
    nodes: dict[str, list[int]] = {}
    for b, info in enumerate(infos):
        nodes.setdefault(info["ip"], []).append(b)
    return [b for bundles in nodes.values() for b in bundles]


def rank_envs(infos: list[dict[str, Any]], master_addr: str, master_port: int) -> list[dict[str, str]]:
    """torch.distributed environment of each rank (``infos`` already in rank order).

    On GPU every rank sees all GPUs that Ray gave this agent on its node and picks its own with
    LOCAL_RANK (NCCL finds NVLink peers only among visible devices). A world whose ranks share one
    node meets on 127.0.0.1 (its store and sockets then listen on loopback only,
    ``models/parallel.py``); a multi-node world meets at ``master_addr``, rank 0's node.
    """
    by_node: dict[str, list[int]] = {}
    for r, info in enumerate(infos):
        by_node.setdefault(info["ip"], []).append(r)
    if len(by_node) == 1:
        master_addr = LOOPBACK
    envs = []
    for r, info in enumerate(infos):
        peers = by_node[info["ip"]]
        env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(r),
               "WORLD_SIZE": str(len(infos)), "LOCAL_RANK": str(peers.index(r)),
               "LOCAL_WORLD_SIZE": str(len(peers))}
        if info["gpu_ids"]:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(g for p in peers for g in infos[p]["gpu_ids"])
        envs.append(env)
    return envs
