"""Engine servers as Ray actors on the cluster's nodes (``rollout.sglang.placement: ray``).

On one host the trainer starts each SGLang server as its own child process on 127.0.0.1. On many
hosts that cannot work: a server must run on a node with free GPUs, bind that node's address, and
be reached by the controller and by the trainer ranks of another node. Here each server is owned by
a :class:`ServerActor` placed on one bundle ``{GPU: tp, CPU: 1}`` of the agent's engine placement
group (a bundle never spans nodes, so a whole engine sits on one node). The actor starts the server
on its node with the GPUs Ray assigned it, bound to the node's address (``ray.util.
get_node_ip_address()``, or ``rollout.sglang.host``), and reports its URL; the controller drives it
over HTTP like any other server, and health checks, restarts and shutdown go through the actor
(:class:`RemoteServer` has the lifecycle of an ``SGLangServer``, so ``SGLangEngine`` and the engine
pool need no change). Ray is imported lazily: nothing here runs without a cluster.

Colocated servers (``rollout.colocate`` with ``placement: ray``, :func:`start_colocated_servers`)
follow an agent's Ray trainer ranks instead: on every node the ranks use, one server per
``rollout.sglang.tp`` of their GPUs, pinned to that node without a bundle of its own (the GPUs are
the ranks' in Ray's accounting; the two take turns on them, trainer/colocation.py).
"""

from __future__ import annotations

import logging
import os
import signal
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from hacrl_megatron.ray_nodes import (  # noqa: F401  (re-exported: the names engines were placed by)
    GPUS_PER_NODE_ENV,
    NODE_RESOURCE,
    describe_node,
    gpus_per_node,
    gpus_per_node_setting,
    placement_timeout,
)
from hacrl_megatron.rollout.protocol import EngineNodeLost

logger = logging.getLogger(__name__)

ACTOR_CALL_TIMEOUT_S = 60.0
R = TypeVar("R")


def planned_nodes(gpu_groups: list[list[int] | None], agent: str) -> list[int | None]:
    """The node index of each engine (its first GPU's job-wide index ``node · gpus_per_node + local``,
    docs/planner.md) when this job says how many GPUs a node has (``$HACRL_GPUS_PER_NODE``), else
    None for every engine (Ray's SPREAD places them anywhere)."""
    per_node = gpus_per_node_setting(f"agent {agent!r}")
    if per_node is None:
        return [None] * len(gpu_groups)
    nodes: list[int | None] = []
    for group in gpu_groups:
        if not group:
            nodes.append(None)
            continue
        node = group[0] // per_node
        if any(g // per_node != node for g in group):
            raise ValueError(f"agent {agent!r}: rollout_gpu_ids {group} span nodes at {per_node} GPUs per node; "
                             "an engine's GPUs must be on one node")
        nodes.append(node)
    return nodes


def bind_host(host: str, node_ip: Callable[[], str]) -> str:
    """The address this node's server binds and advertises for ``rollout.sglang.host``: ``""`` or
    ``{node_ip}``: the node's address as Ray knows it (``node_ip()``); ``{iface:NAME}``: the IPv4
    address of interface NAME on this node (the same placeholder resolves differently on every
    node); anything else as written (config validation refuses a fixed address with placement ray)."""
    if host in ("", "{node_ip}"):
        return node_ip()
    if host.startswith("{iface:") and host.endswith("}"):
        return interface_address(host[len("{iface:"):-1])
    return host


def interface_address(name: str) -> str:
    """IPv4 address of network interface ``name`` on this host (Linux SIOCGIFADDR); OSError naming it."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError as err:
            raise OSError(f"rollout.sglang.host={{iface:{name}}}: interface {name!r} has no IPv4 address on "
                          f"{socket.gethostname()}: {err.strerror}") from None
    return socket.inet_ntoa(packed[20:24])


class ServerActor:
    """Owns one engine server on the node Ray placed it on (wrapped with ``ray.remote`` at run time).

    server_cls: the server class (:class:`~hacrl_megatron.rollout.sglang_server.SGLangServer`); server_kwargs:
    its arguments, less ``host`` and ``gpu_ids`` (this node's address and the GPUs Ray assigned to this
    actor). host: bind address ("" = the node's address as Ray knows it).
    """

    def __init__(self, server_cls: type, server_kwargs: dict[str, Any], host: str = "",
                 shared_gpu_ids: list[int] | None = None) -> None:
        import ray

        self.node_ip = bind_host(host, ray.util.get_node_ip_address)
        gpus = [int(g) for g in ray.get_gpu_ids()]
        tp = int(server_kwargs.get("tp_size", 1))
        # CUDA_VISIBLE_DEVICES for the server: Ray's GPU ids of this actor (it already set them for us);
        # on a node without CUDA (tests with fake GPU resources) the environment is left alone
        gpu_ids = gpus if len(gpus) == tp and _has_cuda() else None
        if shared_gpu_ids is not None:  # colocated: the GPUs Ray counts as the trainer ranks' (this actor has none)
            gpu_ids = None if server_kwargs.get("cpu") else list(shared_gpu_ids)
        self.server = server_cls(host=self.node_ip, gpu_ids=gpu_ids, **server_kwargs)

    def start(self, timeout: float = 900.0) -> str:
        return self.server.start(timeout=timeout)

    def base_url(self) -> str:
        return self.server.base_url

    def is_running(self) -> bool:
        return self.server.is_running()

    def restart(self, timeout: float = 900.0) -> str:
        return self.server.restart(timeout=timeout)

    def stop(self) -> None:
        self.server.stop()

    def kill_server(self) -> int:
        """SIGKILL the server's processes (fault injection: a GPU node losing its engine); returns the pid."""
        proc = self.server.process
        if proc is None:
            return -1
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return proc.pid

    def node(self) -> dict[str, Any]:
        import ray

        return {"ip": self.node_ip, "node_id": ray.get_runtime_context().get_node_id(),
                "gpus": [int(g) for g in ray.get_gpu_ids()]}

    def nccl_version(self) -> list[int] | None:
        """The NCCL the server's interpreter loads on this node (``rollout/nccl_probe.py``), or None."""
        from hacrl_megatron.rollout.nccl_probe import server_nccl_version

        version = server_nccl_version(self.server)
        return None if version is None else list(version)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        return False


class RemoteServer:
    """The controller's handle on a :class:`ServerActor`: the lifecycle of an ``SGLangServer``.

    A restart goes through the actor when it is alive (the server process died). When the actor
    itself is gone (killed, or its worker crashed) a new one is placed on the same bundle of the
    engine's placement group, so on the same node and GPUs, and starts the server on the same port:
    the URL the engine pool and the weight transports know stays valid.
    """

    def __init__(self, actor: Any, base_url: str, tp_size: int, group: _Group | None = None,
                 respawn: Any = None, node_id: str | None = None) -> None:
        self.actor = actor
        self.base_url = base_url
        self.tp_size = tp_size
        self.restarts = 0
        self.node_id = node_id  # the Ray node the server was started on (None: unknown)
        self._group = group
        self._respawn = respawn  # () -> a new ServerActor on this server's bundle (None: cannot)

    def _call(self, method: Callable[..., R], *args: Any, timeout: float = ACTOR_CALL_TIMEOUT_S) -> R:
        """The result of :class:`ServerActor` ``method`` (e.g. ``ServerActor.stop``) run by this server's
        actor, waited for at most ``timeout`` seconds; Ray's errors (a dead actor or node, a timeout)
        propagate. Every operation below is one typed call through here."""
        import ray

        return ray.get(getattr(self.actor, method.__name__).remote(*args), timeout=timeout)

    def is_running(self) -> bool:
        """The server's process runs (False also when its actor or node is gone, or the call failed
        with any Ray error: an out-of-memory kill, a lost node)."""
        import ray

        try:
            return bool(self._call(ServerActor.is_running))
        except ray.exceptions.RayError:
            return False

    def actor_alive(self) -> bool:
        import ray

        try:
            self._call(ServerActor.base_url)
            return True
        except ray.exceptions.RayError:
            return False

    def node_gone(self) -> bool:
        """The Ray node the server was started on has left the cluster (False while unknown)."""
        import ray

        if self.node_id is None:
            return False
        try:
            return not any(n.get("NodeID") == self.node_id and n.get("Alive") for n in ray.nodes())
        except Exception:  # noqa: BLE001 - no answer from the cluster is no evidence of a lost node
            return False

    def restart(self, timeout: float = 900.0) -> str:
        """Start the server again, on the same node and port: through its actor, or, when the actor is
        gone, through a new actor on the same bundle. Raises :class:`EngineNodeLost` at once when the
        node itself is gone: a bundle of an unpinned group would move to another node and its server
        come back at another address, one of a planned group waits for a node that may not return;
        either way the engine is retired rather than reloaded (rollout/engine_pool.py)."""
        if self.actor_alive():
            url = self._call(ServerActor.restart, timeout, timeout=timeout + ACTOR_CALL_TIMEOUT_S)
        elif self.node_gone():
            host = urllib.parse.urlparse(self.base_url).hostname
            raise EngineNodeLost(f"its node {host} (Ray node {self.node_id[:12]}) left the cluster")
        elif self._respawn is not None:
            kill_actor_quietly(self.actor)  # a hung actor, if any, gives its bundle back first
            self.actor = self._respawn()
            self._wait_placed()
            url = self._call(ServerActor.start, timeout, timeout=timeout + ACTOR_CALL_TIMEOUT_S)
        else:
            raise RuntimeError(f"engine at {self.base_url}: its actor is gone and no bundle is known to place a new one")
        if url != self.base_url:
            raise RuntimeError(f"engine actor restarted its server at {url}, expected {self.base_url}")
        self.restarts += 1
        return url

    def _wait_placed(self) -> None:
        """Wait until the replacement actor runs on its bundle (at most ``$HACRL_PLACEMENT_TIMEOUT_S``);
        its node found gone meanwhile (the cluster notices a dead node within seconds) raises
        :class:`EngineNodeLost` instead of waiting for a bundle that cannot be placed."""
        import time

        import ray

        deadline = time.monotonic() + placement_timeout()
        while True:
            try:
                self._call(ServerActor.base_url, timeout=2.0)
                return
            except ray.exceptions.GetTimeoutError:
                pass
            if self.node_gone():
                kill_actor_quietly(self.actor)
                host = urllib.parse.urlparse(self.base_url).hostname
                raise EngineNodeLost(f"its node {host} (Ray node {self.node_id[:12]}) left the cluster")
            if time.monotonic() > deadline:
                kill_actor_quietly(self.actor)
                raise RuntimeError(f"engine at {self.base_url}: its replacement actor was not placed on its bundle "
                                   f"within {placement_timeout():g} s")

    def stop(self) -> None:
        """Stop the server, kill its actor and give its bundle back (idempotent). A close path: any Ray
        error on the way (a dead actor or node, an out-of-memory kill, a call timeout) is logged, never
        raised, and the placement group is released whatever happened before."""
        import ray

        try:
            try:
                self._call(ServerActor.stop)
            except ray.exceptions.RayError as err:
                logger.debug("engine at %s: stop through its actor failed (%s); killing the actor", self.base_url,
                             type(err).__name__)
            kill_actor_quietly(self.actor)
        finally:
            group, self._group = self._group, None
            if group is not None:
                group.release_one()

    def node(self) -> dict[str, Any]:
        """The node the server runs on: its address, Ray node id and GPU ids."""
        return self._call(ServerActor.node)

    def nccl_version(self) -> list[int] | None:
        """The NCCL of the server's interpreter, read by its actor on its node; None when unknown."""
        import ray

        from hacrl_megatron.rollout.nccl_probe import PROBE_TIMEOUT_S

        try:
            return self._call(ServerActor.nccl_version, timeout=PROBE_TIMEOUT_S + ACTOR_CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None

    def kill_server(self) -> int:
        """SIGKILL the server on its node (fault injection); the actor stays, so a restart goes through it."""
        return self._call(ServerActor.kill_server)

    def kill_actor(self) -> None:
        """Kill the server's actor (fault injection: its worker process dies, the server with it)."""
        import ray

        try:
            self._call(ServerActor.kill_server)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        ray.kill(self.actor, no_restart=True)


class _Group:
    """An engine placement group shared by its servers; removed when the last of them stops."""

    def __init__(self, group: Any, members: int) -> None:
        self.group, self.remaining = group, members

    def release_one(self) -> None:
        import ray

        self.remaining -= 1
        if self.remaining == 0:
            remove_group_quietly(ray, self.group)


def kill_actor_quietly(actor: Any) -> None:
    """``ray.kill`` on a close path: a failure (the cluster already gone) is logged, not raised."""
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception as err:  # noqa: BLE001 - closing must go on for the other resources
        logger.warning("could not kill Ray actor %s: %s: %s", actor, type(err).__name__, err)


def remove_group_quietly(ray: Any, group: Any) -> None:
    """``remove_placement_group`` on a close path: a failure is logged, not raised."""
    try:
        ray.util.remove_placement_group(group)
    except Exception as err:  # noqa: BLE001 - closing must go on for the other resources
        logger.warning("could not remove placement group %s: %s: %s", getattr(group, "id", group),
                       type(err).__name__, err)


def start_remote_servers(server_cls: type, server_kwargs: list[dict[str, Any]], tp: int, host: str = "",
                         timeout: float = 900.0, nodes: list[int | None] | None = None,
                         name: str = "") -> list[RemoteServer]:
    """One :class:`ServerActor` of ``server_cls`` per entry of ``server_kwargs`` on its own ``{GPU: tp, CPU: 1}`` bundle of a
    new placement group (SPREAD: engines on as many nodes as the cluster offers). ``nodes[k]``: the
    job node index engine ``k`` must run on (its bundle then asks for that node's resource,
    ``hacrl_node_<k>``; None: anywhere; on a launched multi-node job ``$HACRL_GPUS_PER_NODE`` must be
    set). Returns the handles, in order, once every server answers; the group (named after the agent
    ``name``) goes when the last of them stops; a group the cluster does not place within
    ``$HACRL_PLACEMENT_TIMEOUT_S`` (300 s) fails naming the agent, the planned nodes and what holds
    their GPUs. Joins the Ray cluster at ``$RAY_ADDRESS`` when this process is not connected yet (a
    new local one without it)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray = _connected_ray()
    who = f"agent {name!r}: engines" if name else "engines"
    gpus_per_node(ray, who)  # a launched multi-node job without $HACRL_GPUS_PER_NODE is refused here
    nodes = nodes if nodes is not None else [None] * len(server_kwargs)
    bundles = [{"GPU": float(tp), "CPU": 1.0} for _ in server_kwargs]
    have = ray.cluster_resources()
    for bundle, node in zip(bundles, nodes, strict=True):
        if node is None:
            continue
        name = NODE_RESOURCE.format(node)
        if name not in have:
            raise RuntimeError(f"engine planned on node {node}: the Ray cluster has no node with resource {name!r} "
                               f"(nodes of a `hacrl launch` job carry hacrl_node_<Slurm node index>; unset "
                               f"${GPUS_PER_NODE_ENV} to let Ray place engines anywhere)")
        bundle[name] = 1.0
    import uuid

    group = placement_group(bundles, strategy="SPREAD", name=f"hacrl-{name or 'agent'}-engines-{uuid.uuid4().hex[:8]}")
    wait = placement_timeout()
    if not group.wait(timeout_seconds=wait):
        remove_group_quietly(ray, group)
        planned = sorted({n for n in nodes if n is not None})
        if planned:
            raise RuntimeError(f"{who} planned on {', '.join(f'node {n}' for n in planned)} not placed within "
                               f"{wait:g} s: " + "; ".join(describe_node(ray, n) for n in planned))
        raise RuntimeError(f"{who}: no room in the Ray cluster for {len(bundles)} engine(s) of {tp} GPU(s) each "
                           f"within {wait:g} s (ray.available_resources(): {ray.available_resources()})")
    remote = ray.remote(ServerActor)

    def place(index: int, kwargs: dict[str, Any]) -> Any:
        return remote.options(num_gpus=tp, num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=index)).remote(server_cls, kwargs, host)

    actors = [place(i, kwargs) for i, kwargs in enumerate(server_kwargs)]
    try:
        urls = ray.get([a.start.remote(timeout) for a in actors], timeout=timeout + ACTOR_CALL_TIMEOUT_S)
    except BaseException:
        for a in actors:
            kill_actor_quietly(a)
        remove_group_quietly(ray, group)
        raise
    try:
        where = ray.get([a.node.remote() for a in actors], timeout=ACTOR_CALL_TIMEOUT_S)
    except BaseException:
        for a in actors:
            kill_actor_quietly(a)
        remove_group_quietly(ray, group)
        raise
    shared = _Group(group, len(actors))

    def respawner(index: int, url: str) -> Any:  # a replacement actor serves on the same port
        kwargs = {**server_kwargs[index], "port": urllib.parse.urlparse(url).port}
        return lambda: place(index, kwargs)

    return [RemoteServer(a, url, tp, shared, respawner(i, url), node_id=w["node_id"])
            for i, (a, url, w) in enumerate(zip(actors, urls, where))]


def _connected_ray() -> Any:
    """Ray, joined to the cluster at ``$RAY_ADDRESS`` when this process is not connected yet (a new
    local one without it)."""
    import ray

    if not ray.is_initialized():
        from hacrl_megatron.sockets import ray_temp_dir

        address = os.environ.get("RAY_ADDRESS")
        short = ray_temp_dir() if address is None else None  # a new local cluster under a long TMPDIR
        ray.init(address=address, log_to_driver=False, **({"_temp_dir": short} if short else {}))
    return ray


@dataclass(frozen=True)
class SharedGPUs:
    """Where one colocated server runs: a Ray node and GPUs of it that an agent's trainer ranks hold."""

    node_id: str
    gpu_ids: tuple[int, ...]


def colocated_shares(rank_placement: list[dict[str, Any]] | None, tp: int, agent: str) -> list[SharedGPUs]:
    """The colocated servers of an agent whose Ray ranks are placed as ``rank_placement`` (per rank, in
    rank order: ``node_id`` and Ray's ``gpu_ids``, agents/ray_worker.RankWorker.node_info): on every
    node the ranks use, its trainer GPUs in ascending order, ``tp`` per server. ValueError naming the
    field when the ranks are not Ray ranks or a node's share is not a multiple of ``tp``."""
    if not rank_placement:
        raise ValueError(f"agent {agent!r}: colocated servers with rollout.sglang.placement=ray share the GPUs of the "
                         "agent's Ray ranks, and this agent has none (agents.N.workers: ray)")
    by_node: dict[str, list[int]] = {}
    for rank in rank_placement:
        by_node.setdefault(rank["node_id"], []).extend(int(g) for g in rank["gpu_ids"])
    shares = []
    for node_id, gpus in by_node.items():
        gpus = sorted(gpus)
        if not gpus or len(gpus) % tp:
            raise ValueError(f"rollout.sglang.tp={tp}: agent {agent!r} has {len(gpus)} trainer GPU(s) on Ray node "
                             f"{node_id[:12]}; colocated servers of {tp} GPUs each must tile every node's share")
        shares += [SharedGPUs(node_id, tuple(gpus[k:k + tp])) for k in range(0, len(gpus), tp)]
    return shares


def start_colocated_servers(server_cls: type, server_kwargs: list[dict[str, Any]], tp: int,
                            shares: list[SharedGPUs], host: str = "", timeout: float = 900.0) -> list[RemoteServer]:
    """One :class:`ServerActor` per entry of ``server_kwargs`` on the node and GPUs of ``shares[k]``
    (``rollout.colocate`` with ``placement: ray``, docs/colocation.md): the GPUs are the trainer ranks'
    in Ray's accounting, so the actor asks for none (and no CPU either: a node's CPUs may all be the
    ranks' bundles; it only supervises the server's process) and is pinned to the node. Returns the
    handles, in order, once every server answers; a lost actor is replaced on the same node and GPUs."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray = _connected_ray()
    remote = ray.remote(ServerActor)

    def place(index: int, kwargs: dict[str, Any]) -> Any:
        share = shares[index]
        return remote.options(num_gpus=0, num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_id=share.node_id, soft=False)).remote(server_cls, kwargs, host, list(share.gpu_ids))

    actors = [place(i, kwargs) for i, kwargs in enumerate(server_kwargs)]
    try:
        urls = ray.get([a.start.remote(timeout) for a in actors], timeout=timeout + ACTOR_CALL_TIMEOUT_S)
    except BaseException:
        for a in actors:
            kill_actor_quietly(a)
        raise

    def respawner(index: int, url: str) -> Any:  # a replacement actor serves on the same port
        kwargs = {**server_kwargs[index], "port": urllib.parse.urlparse(url).port}
        return lambda: place(index, kwargs)

    return [RemoteServer(a, url, tp, None, respawner(i, url), node_id=shares[i].node_id)
            for i, (a, url) in enumerate(zip(actors, urls))]
