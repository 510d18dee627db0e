"""``RayAgent``: an :class:`~hacrl_megatron.agents.handle.AgentHandle` whose ranks are Ray actors.

docs/architecture.md, "One agent = one Megatron world": the agent's TP×PP×DP ranks are ``tp*pp*dp`` Ray actors
in one placement group (one bundle per rank: 1 CPU, plus 1 GPU on GPU clusters; STRICT_PACK when
the group fits one node so TP stays on NVLink, else PACK). Each actor joins its own
``torch.distributed`` world (gloo on CPU, nccl on GPU; the rendezvous port is picked on rank 0's
node) and builds a :class:`~hacrl_megatron.agents.local.LocalAgent` in it. Two agents with
different layouts are two such groups, side by side on one cluster; the controller drives both.

Every call is SPMD: the same method runs on every rank (arguments are put into the object store
once) and the result of rank 0 is returned; ``LocalAgent`` makes each result available on every
rank (log-probs are all-reduced, metrics all-gathered, exported tensors broadcast). Exported
weights come back in buckets of ``bucket_bytes`` through Ray object refs, so neither the actors
nor the controller hold the whole model at once.

A failing rank (a dead actor or an exception) leaves the other ranks inside collectives, so the
whole world is torn down and the error names the agent and the rank; build a new agent (or load a
checkpoint) to continue. Checkpoint paths must be on a filesystem every node sees.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hacrl_megatron.agents.batch import LogProbOutput, LossFn, SequenceBatch

DEFAULT_BUCKET_BYTES = 1 << 30  # ~1 GB of exported weights per object-store round trip
INSTALL_HINT = "pip install ray  (or the package's launch extra: pip install 'hacrl_megatron[launch]')"


class RayAgentError(RuntimeError):
    """The agent's Ray world cannot be placed, or one of its ranks failed (message names agent and rank)."""


def require_ray() -> Any:
    """The ``ray`` module, or an ImportError that says what to install."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(f"RayAgent needs Ray, which is not installed: {INSTALL_HINT}") from err
    return ray


def ensure_ray(address: str | None = None, **init_kwargs: Any) -> Any:
    """``ray.init`` once per process: joins ``address`` / ``$RAY_ADDRESS`` / a local ``ray start``
    cluster when one exists, else starts a private one. Returns the ``ray`` module."""
    ray = require_ray()
    if not ray.is_initialized():
        init_kwargs.setdefault("include_dashboard", False)
        init_kwargs.setdefault("log_to_driver", True)
        ray.init(address=address, **init_kwargs)
    return ray


@dataclasses.dataclass(frozen=True)
class SharedStateDict:
    """An HF state dict as numpy arrays, which Ray's object store hands to every actor on a node
    zero-copy (one shared-memory copy per node; torch tensors would be deserialized per rank).

    arrays: name -> contiguous array (bfloat16 travels as its int16 bit pattern).
    dtypes: name -> the torch dtype name to view the array as.
    """

    arrays: dict[str, Any]
    dtypes: dict[str, str]

    @classmethod
    def from_tensors(cls, state: dict[str, torch.Tensor]) -> SharedStateDict:
        arrays, dtypes = {}, {}
        for name, t in state.items():
            t = t.detach().cpu().contiguous()
            dtypes[name] = str(t.dtype).removeprefix("torch.")
            if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bits
                t = t.view(torch.int16)
            arrays[name] = t.numpy()
        return cls(arrays, dtypes)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Read-only tensor views of the arrays (the loader only slices and copies them)."""
        import warnings

        out = {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            for name, arr in self.arrays.items():
                out[name] = torch.from_numpy(arr).view(getattr(torch, self.dtypes[name]))
        return out


# --------------------------------------------------------------------------------------------
# one rank (runs inside a Ray actor process)


class RankWorker:
    """One rank of an agent's world. Decorated with ``ray.remote`` by :func:`_remote_worker_class`."""

    def __init__(self, agent_name: str) -> None:
        self.agent_name = agent_name
        self.agent: Any = None
        self._export: Iterator[tuple[str, torch.Tensor]] | None = None

    def node_info(self) -> dict[str, Any]:
        """Where Ray placed this actor: node IP, the GPU ids Ray gave it, pid."""
        import ray

        return {"ip": ray.util.get_node_ip_address(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "pid": os.getpid(), "host": socket.gethostname()}

    def free_port(self) -> int:
        """A TCP port free on all interfaces of this node (the world's rendezvous port)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, env: dict[str, str], threads: int, agent_cfg: Any, train_cfg: Any, hf_checkpoint: Any,
              hf_config: Any, vocab_size: int | None, total_updates: int | None) -> dict[str, Any]:
        """Join the world described by ``env`` (RANK, WORLD_SIZE, MASTER_*) and build the LocalAgent."""
        os.environ.update(env)  # before torch touches CUDA: CUDA_VISIBLE_DEVICES / LOCAL_RANK apply
        if threads > 0:
            torch.set_num_threads(threads)
        from hacrl_megatron.agents.local import LocalAgent

        if isinstance(hf_checkpoint, SharedStateDict):
            hf_checkpoint = hf_checkpoint.to_tensors()
        self.agent = LocalAgent(agent_cfg, train_cfg, vocab_size=vocab_size, hf_checkpoint=hf_checkpoint,
                                hf_config=hf_config, total_updates=total_updates)
        return {"info": dataclasses.asdict(self.agent.info), "spec": self.agent.spec,
                "hf_config": self.agent.hf_config, "num_parameters": self.agent.num_parameters()}

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``LocalAgent.<method>(*args, **kwargs)`` on this rank."""
        fn = getattr(self.agent, method, None)
        if fn is None:
            raise AttributeError(f"LocalAgent has no method {method!r} (hacrl_megatron.agents.local)")
        return fn(*args, **kwargs)

    def export_begin(self) -> None:
        self._export = iter(self.agent.export_hf_weights())

    def export_bucket(self, max_bytes: int, keep: bool) -> tuple[list[str], list[tuple[str, torch.Tensor]]]:
        """Next tensors of the export stream up to ``max_bytes`` (at least one; none once the stream
        is done): (names, tensors if ``keep``).

        Every rank must advance the stream together (each tensor is a TP gather / PP broadcast);
        tensors are identical on all ranks, so byte counts and bucket boundaries agree.
        """
        names: list[str] = []
        kept: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in self._export:
            names.append(name)
            if keep:
                kept.append((name, tensor.detach().cpu()))
            size += tensor.numel() * tensor.element_size()
            if size >= max_bytes:
                break
        return names, kept


_REMOTE_CLASS: Any = None


def _remote_worker_class(ray: Any) -> Any:
    global _REMOTE_CLASS
    if _REMOTE_CLASS is None:
        _REMOTE_CLASS = ray.remote(RankWorker)
    return _REMOTE_CLASS


# --------------------------------------------------------------------------------------------
# placement


def _layout(agent_cfg: Any) -> tuple[int, int, int]:
    p = agent_cfg.parallel
    return p.tp, p.pp, p.dp


def _describe(agent_cfg: Any) -> str:
    tp, pp, dp = _layout(agent_cfg)
    return f"agent {agent_cfg.name!r} (tp={tp}, pp={pp}, dp={dp}: {tp * pp * dp} ranks)"


def _check_cluster(ray: Any, agent_cfg: Any, bundle: dict[str, float]) -> str:
    """Raise when the whole cluster is too small; return the placement strategy to use."""
    tp, pp, dp = _layout(agent_cfg)
    world = tp * pp * dp
    total = ray.cluster_resources()
    have = {k: float(total.get(k, 0.0)) for k in bundle}
    need = {k: v * world for k, v in bundle.items()}
    short = {k: (need[k], have[k]) for k in bundle if have[k] < need[k]}
    if short:
        parts = ", ".join(f"{k}: needs {n:g}, cluster has {h:g}" for k, (n, h) in short.items())
        raise RayAgentError(f"{_describe(agent_cfg)} needs one bundle {bundle} per rank; {parts}. "
                            "Add nodes/resources to the Ray cluster or shrink the layout")
    fits_one = any(all(float(n.get("Resources", {}).get(k, 0.0)) >= need[k] for k in bundle)
                   for n in ray.nodes() if n.get("Alive", False))
    return "STRICT_PACK" if fits_one else "PACK"


def _rank_order(infos: list[dict[str, Any]]) -> list[int]:
    """Bundle indices in rank order: ranks of one node are contiguous (TP groups stay intra-node),
    nodes in the order of their first bundle, bundles in index order within a node."""
    nodes: dict[str, list[int]] = {}
    for b, info in enumerate(infos):
        nodes.setdefault(info["ip"], []).append(b)
    return [b for bundles in nodes.values() for b in bundles]


def rank_envs(infos: list[dict[str, Any]], master_addr: str, master_port: int) -> list[dict[str, str]]:
    """torch.distributed environment of each rank (``infos`` already in rank order).

    On GPU every rank sees all GPUs that Ray gave this agent on its node and picks its own with
    LOCAL_RANK (NCCL finds NVLink peers only among visible devices).
    """
    by_node: dict[str, list[int]] = {}
    for r, info in enumerate(infos):
        by_node.setdefault(info["ip"], []).append(r)
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


# --------------------------------------------------------------------------------------------
# the controller-side handle


@dataclasses.dataclass
class PendingCall:
    """An SPMD call in flight on every rank of ``agent`` (one object ref per rank, rank order)."""

    agent: RayAgent
    refs: list[Any]
    what: str

    def results(self) -> list[Any]:
        """Wait; every rank's result (a failure tears the agent's world down, see RayAgent)."""
        return self.agent._gather(self.refs, self.what)

    def result(self) -> Any:
        """Wait; rank 0's result (LocalAgent makes results identical on every rank)."""
        return self.results()[0]


class RayAgent:
    """One Megatron agent whose ``tp*pp*dp`` ranks are Ray actors (see module docstring).

    Args mirror :class:`~hacrl_megatron.agents.local.LocalAgent` (``agent``: AgentConfig, ``train``:
    TrainConfig, ``vocab_size``, ``hf_checkpoint`` (an HF directory on a shared filesystem, or an
    HF-named state dict, shipped once through the object store), ``hf_config``, ``total_updates``),
    plus the placement:

        use_gpu: one GPU per rank and nccl; default: the cluster has GPUs.
        cpus_per_rank: CPUs in each rank's bundle (also its torch intra-op threads on CPU).
        placement_timeout_s: how long to wait for the cluster to free the bundles.
        call_timeout_s: limit for any single SPMD call (None: no limit; training steps can be long).
        bucket_bytes: bytes of exported weights per object-store transfer.
        env_vars: extra environment of every rank (e.g. NCCL_DEBUG, GLOO_SOCKET_IFNAME).
    """

    def __init__(self, agent: Any, train: Any, *, vocab_size: int | None = None, hf_checkpoint: Any = None,
                 hf_config: Any = None, total_updates: int | None = None, use_gpu: bool | None = None,
                 cpus_per_rank: int = 1, placement_timeout_s: float = 300.0, call_timeout_s: float | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, env_vars: dict[str, str] | None = None) -> None:
        if cpus_per_rank < 1:
            raise ValueError(f"cpus_per_rank={cpus_per_rank}: must be >= 1")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}: must be >= 1")
        ray = ensure_ray()
        self.name = agent.name
        self.layout = _layout(agent)
        self.world_size = self.layout[0] * self.layout[1] * self.layout[2]
        self.call_timeout_s = call_timeout_s
        self.bucket_bytes = int(bucket_bytes)
        self._dead: str | None = None
        self._workers: list[Any] = []
        self._pg: Any = None
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0.0) > 0
        bundle = {"CPU": float(cpus_per_rank), **({"GPU": 1.0} if use_gpu else {})}
        try:
            self._start(ray, agent, bundle, placement_timeout_s, env_vars or {})
            if isinstance(hf_checkpoint, dict):  # one shared-memory copy per node for all its ranks
                hf_checkpoint = ray.put(SharedStateDict.from_tensors(hf_checkpoint))
            threads = 0 if use_gpu else cpus_per_rank
            refs = [w.setup.remote(env, threads, agent, train, hf_checkpoint, hf_config, vocab_size, total_updates)
                    for w, env in zip(self._workers, self._envs)]
            results = self._gather(refs, "setup")
        except BaseException:
            self.shutdown()
            raise
        self.infos = [r["info"] for r in results]
        self.spec, self.hf_config = results[0]["spec"], results[0]["hf_config"]
        self._num_parameters = int(results[0]["num_parameters"])

    @classmethod
    def from_hf_model(cls, agent: Any, hf_model: Any, *, train: Any, total_updates: int | None = None,
                      **placement: Any) -> RayAgent:
        """An agent initialised from an in-memory transformers causal LM (its config and weights),
        the weights shipped once via ``ray.put`` as a :class:`SharedStateDict`; ``placement``: see
        the class. For models too large for one host's memory pass ``hf_checkpoint=<HF dir>`` on a
        shared filesystem to the constructor instead: each rank then reads only its own shards."""
        return cls(agent, train, hf_checkpoint=dict(hf_model.state_dict()), hf_config=hf_model.config,
                   total_updates=total_updates, **placement)

    # ----------------------------------------------------------------------------------------
    def _start(self, ray: Any, agent: Any, bundle: dict[str, float], timeout_s: float, env_vars: dict) -> None:
        """Placement group, one actor per bundle, ranks ordered by node, rendezvous on rank 0's node."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = _check_cluster(ray, agent, bundle)
        self._pg = placement_group([dict(bundle)] * self.world_size, strategy=strategy,
                                   name=f"hacrl-{self.name}-{uuid.uuid4().hex[:8]}")
        ready, _ = ray.wait([self._pg.ready()], timeout=timeout_s)
        if not ready:
            raise RayAgentError(
                f"{_describe(agent)}: placement group of {self.world_size} bundles {bundle} ({strategy}) not ready "
                f"after {timeout_s:g} s; free now: {ray.available_resources()} (other agents may hold the rest)")
        # Workers import hacrl_megatron from where this process does (an uninstalled checkout works too).
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        runtime_env = {"env_vars": {"PYTHONPATH": path, **env_vars}}
        cls = _remote_worker_class(ray)
        actors = [
            cls.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), runtime_env=runtime_env,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self._pg, placement_group_bundle_index=b)).remote(self.name)
            for b in range(self.world_size)
        ]
        self._workers = actors  # bundle order until ranks are known (for shutdown on failure)
        infos = self._gather([a.node_info.remote() for a in actors], "start")
        order = _rank_order(infos)
        self._workers = [actors[b] for b in order]
        infos = [infos[b] for b in order]
        port = self._gather([self._workers[0].free_port.remote()], "start")[0]
        self._envs = rank_envs(infos, infos[0]["ip"], port)
        self.nodes = [info["ip"] for info in infos]

    def _gather(self, refs: list[Any], what: str) -> list[Any]:
        """Results of one SPMD call (one ref per rank, in rank order); any failure tears the world down."""
        ray = require_ray()
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        rank_of = {ref: r for r, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=self.call_timeout_s)
            if not ready:
                late = sorted(rank_of[r] for r in pending)
                self._fail(f"{what} timed out after {self.call_timeout_s:g} s on ranks {late}")
                raise RayAgentError(f"agent {self.name!r}: {what} did not finish within {self.call_timeout_s:g} s on "
                                    f"ranks {late}; the agent's workers were shut down")
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayTaskError as err:
                cause = err.as_instanceof_cause()
                self._fail(f"rank {rank} raised {type(err.cause).__name__} during {what}")
                cause.add_note(f"[hacrl] agent {self.name!r}: raised on rank {rank} during {what}; "
                               "the agent's workers were shut down")
                raise cause from None
            except (RayActorError, GetTimeoutError) as err:
                self._fail(f"rank {rank} died during {what}")
                raise RayAgentError(f"agent {self.name!r}: worker of rank {rank}/{len(refs)} died during {what} "
                                    f"({type(err).__name__}: {err}); the agent's workers were shut down") from err
        return results

    def _submit(self, method: str, *args: Any) -> PendingCall:
        """Start ``LocalAgent.<method>(*args)`` on every rank; arguments cross the object store once."""
        ray = require_ray()
        self._check_alive()
        arg_refs = [ray.put(a) for a in args]
        return PendingCall(self, [w.call.remote(method, *arg_refs) for w in self._workers], method)

    def _call(self, method: str, *args: Any) -> list[Any]:
        """Every rank's result of ``LocalAgent.<method>(*args)``, in rank order."""
        return self._submit(method, *args).results()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise RayAgentError(f"agent {self.name!r} is shut down ({self._dead}); build a new RayAgent")

    def _fail(self, reason: str) -> None:
        self.shutdown(reason)

    # ----------------------------------------------------------------------------------------
    # AgentHandle
    def sequence_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Σ log π of each response [S] (float32, at ``temperature``) and its token count [S]."""
        return self._call("sequence_logprobs", batch, temperature)[0]

    def token_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> LogProbOutput:
        """Per-token log-probs of the responses (packed, see :class:`LogProbOutput`); needs
        ``LocalAgent.token_logprobs``."""
        return self._call("token_logprobs", batch, temperature)[0]

    def train(self, mini_batches: list[SequenceBatch], loss_fn: LossFn, temperature: float = 1.0) -> list[dict[str, float]]:
        """One optimizer update per mini-batch (m = 0..M−1); ``loss_fn`` is cloudpickled to every rank."""
        return self.train_async(mini_batches, loss_fn, temperature).result()

    def train_async(self, mini_batches: list[SequenceBatch], loss_fn: LossFn, temperature: float = 1.0) -> PendingCall:
        """:meth:`train` started without waiting: agents on disjoint resources then update concurrently
        (``[a.train_async(...) for a in agents]``, then ``.result()`` each). Later calls on the same
        agent queue behind it."""
        return self._submit("train", list(mini_batches), loss_fn, temperature)

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors (gathered across TP/PP), streamed from rank 0 in ``bucket_bytes`` buckets.

        The next bucket is produced while the caller consumes the current one, so at most two
        buckets are in flight. Abandoning the iterator early is safe: every rank stops on a
        tensor boundary and the next export starts a fresh stream.
        """
        self._check_alive()
        self._gather([w.export_begin.remote() for w in self._workers], "export_hf_weights")
        return self._export_stream()

    def _next_bucket(self) -> list[Any]:
        return [w.export_bucket.remote(self.bucket_bytes, r == 0) for r, w in enumerate(self._workers)]

    def _export_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        refs = self._next_bucket()
        while True:
            results = self._gather(refs, "export_hf_weights")
            names, tensors = results[0]
            for rank, (other, _) in enumerate(results[1:], start=1):
                if other != names:
                    self._fail(f"export streams diverged on rank {rank}")
                    raise RayAgentError(f"agent {self.name!r}: rank {rank} exported {other[:3]}... while rank 0 "
                                        f"exported {names[:3]}...; the agent's workers were shut down")
            if not names:
                return
            refs = self._next_bucket()
            yield from tensors

    def save(self, path: str) -> None:
        """Model + optimizer + scheduler under ``path`` (every rank writes its shard: a shared filesystem)."""
        self._call("save", str(path))

    def load(self, path: str) -> None:
        """Restore :meth:`save`'s state, possibly written at another TP/PP layout."""
        self._call("load", str(path))

    def stats(self) -> dict[str, float]:
        """Rank 0's counters (tokens/s, updates); ``peak_*`` memory is the maximum over ranks."""
        per_rank = self._call("stats")
        out = dict(per_rank[0])
        for key in out:
            if key.startswith("peak_"):
                out[key] = max(float(s.get(key, 0.0)) for s in per_rank)
        out["ranks"] = float(self.world_size)
        return out

    def num_parameters(self) -> int:
        """Parameters of the whole model as HF counts them."""
        return self._num_parameters

    # ----------------------------------------------------------------------------------------
    def shutdown(self, reason: str = "shutdown() was called") -> None:
        """Kill the rank actors and release the placement group (idempotent)."""
        if self._dead is not None and not self._workers:
            return
        self._dead = self._dead or reason
        ray = require_ray()
        workers, self._workers = self._workers, []
        for w in workers:
            ray.kill(w, no_restart=True)
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None

    def __enter__(self) -> RayAgent:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def build_ray_agent(agent_cfg: Any, hf_model: Any, train_cfg: Any, total_updates: int | None, **placement: Any) -> RayAgent:
    """The trainer's switch (``AgentConfig.workers == "ray"``): a RayAgent from the agent's starting HF model."""
    return RayAgent.from_hf_model(agent_cfg, hf_model, train=train_cfg, total_updates=total_updates, **placement)
