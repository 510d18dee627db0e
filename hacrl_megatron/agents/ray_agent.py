"""``RayAgent``: an :class:`~hacrl_megatron.agents.handle.AgentHandle` whose ranks are Ray actors.

One agent is one Megatron world (docs/architecture.md): the agent's TP×PP×CP×DP ranks are
``tp*pp*cp*dp`` Ray actors in one placement group (one bundle per rank: 1 CPU, plus 1 GPU on GPU
clusters; STRICT_PACK when the group fits one node so TP stays on NVLink, else PACK). Each actor joins its own
``torch.distributed`` world (gloo on CPU, nccl on GPU; the rendezvous port is picked on rank 0's
node) and builds a :class:`~hacrl_megatron.agents.local.LocalAgent` in it. Two agents with
different layouts are two such groups, side by side on one cluster; the controller drives both.

The work is split in three modules: :mod:`~hacrl_megatron.agents.ray_placement` (Ray, placement
group, rank order and environments), :mod:`~hacrl_megatron.agents.ray_worker` (the rank actor) and
this facade, which drives the ranks and holds the calls in flight (:class:`PendingCall`).

Every call is SPMD: the same method runs on every rank (arguments are put into the object store
once) and the result of rank 0 is returned; ``LocalAgent`` makes each result available on every
rank (log-probs are all-reduced, metrics all-gathered, exported tensors broadcast). Exported
weights come back in buckets of ``bucket_bytes`` through Ray object refs, so neither the actors
nor the controller hold the whole model at once.

Weights bound for rollout servers need not come back at all: the export stream
(:class:`RayExport`) tells a weight transport that can run on the ranks (``rollout.weight_sync
= distributed``, sync/distributed.py) to do so. It then builds one sender per rank
(:meth:`RayAgent.open_weight_sender`) and each push (:meth:`RayAgent.push_weights`) runs on
every rank: all ranks gather across TP/PP in their export, rank 0 broadcasts the buckets into
the servers; with PP > 1 each stage's first rank sends its own stage's share instead, gathered
within the stage only (sync/stages.py, docs/weight_sync.md). A server failing a push is raised to
the caller without tearing the world down.

A failing rank (a dead actor or an exception) leaves the other ranks inside collectives, so the
whole world is torn down and the error names the agent and the rank; build a new agent (or load a
checkpoint) to continue. Checkpoint paths must be on a filesystem every node sees.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch

from hacrl_megatron.agents.batch import LogProbOutput, LossFn, SequenceBatch
from hacrl_megatron.agents.checkpoint_io import DigestMismatchError
from hacrl_megatron.agents.ray_placement import (
    RayAgentError,
    TrainerNodeLost,
    ensure_ray,
    node_left,
    rank_bundle,
    rank_envs,
    rank_order,
    release,
    require_ray,
    reserve,
    spawn_actors,
)
from hacrl_megatron.agents.ray_worker import (
    PushOutcome,
    RankWorker,
    SharedStateDict,
    WeightSender,
    WorkerSetup,
    push_total,
    remote_worker_class,
)
from hacrl_megatron.config import AgentConfig, TrainConfig
from hacrl_megatron.models.resolved import ResolvedAgent
from hacrl_megatron.ray_nodes import placement_timeout

__all__ = ["DEFAULT_BUCKET_BYTES", "PendingCall", "RayAgent", "RayAgentError", "RayExport", "TrainerNodeLost",
           "build_ray_agent"]

DEFAULT_BUCKET_BYTES = 1 << 30  # ~1 GB of exported weights per object-store round trip
# a rank's error that means a peer's connection went away (gloo, NCCL): maybe the peer's node left
PEER_LOST_MARKERS = ("closed by peer", "reset by peer", "Connection refused", "Broken pipe", "NCCL")
PEER_LOSS_WAIT_S = 60.0  # how long such an error waits for the cluster to tell whether a node left
R = TypeVar("R")

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PendingCall(Generic[R]):
    """An SPMD call in flight on every rank of ``agent`` (one object ref per rank, rank order)."""

    agent: RayAgent
    refs: list[Any]
    what: str

    def results(self) -> list[R]:
        """Wait; every rank's result (a failure tears the agent's world down, see RayAgent)."""
        return self.agent._gather(self.refs, self.what)

    def result(self) -> R:
        """Wait; rank 0's result (LocalAgent makes results identical on every rank)."""
        return self.results()[0]


class RayExport(Iterator[tuple[str, torch.Tensor]]):
    """:meth:`RayAgent.export_hf_weights`' stream. Lazy: the ranks start exporting at the first
    tensor asked for, so a transport that has the ranks push themselves (``ranks``) never costs
    an export here."""

    def __init__(self, agent: RayAgent) -> None:
        self.ranks = agent
        self._stream: Iterator[tuple[str, torch.Tensor]] | None = None

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._stream is None:
            self._stream = self.ranks._export_stream()
        return next(self._stream)


class RayAgent:
    """One Megatron agent whose ``tp*pp*cp*dp`` ranks are Ray actors (see module docstring).

    Args mirror :class:`~hacrl_megatron.agents.local.LocalAgent` (``agent_cfg``, ``train_cfg``,
    ``vocab_size``, ``hf_checkpoint`` (an HF directory on a shared filesystem, or an HF-named state
    dict, shipped once through the object store), ``hf_config``, ``total_updates``), plus the
    placement:

        use_gpu: one GPU per rank in its bundle (nccl where the rank sees CUDA, else gloo); default:
            the cluster has GPUs.
        cpus_per_rank: CPUs in each rank's bundle (also its torch intra-op threads on CPU).
        placement_timeout_s: how long to wait for the cluster to free the bundles (None:
            ``$HACRL_PLACEMENT_TIMEOUT_S``, default 300).
        node_spans: (node, ranks) in rank order: the job nodes the plan puts the ranks on (each
            bundle then asks for its node's ``hacrl_node_<k>`` resource); None: anywhere.
        call_timeout_s: limit for any single SPMD call (None: no limit; training steps can be long).
        bucket_bytes: bytes of exported weights per object-store transfer.
        env_vars: extra environment of every rank (e.g. NCCL_DEBUG, GLOO_SOCKET_IFNAME).
        resolved: the run's record of the agent (models/resolved.py), handed to every rank, which then
            reads no HF config itself.
    """

    runs_in_process = False  # its ranks compute in their own processes: the loop overlaps agents (trainer/concurrency.py)

    def __init__(self, agent_cfg: AgentConfig, train_cfg: TrainConfig, *, vocab_size: int | None = None,
                 hf_checkpoint: Any = None, hf_config: Any = None, total_updates: int | None = None,
                 use_gpu: bool | None = None, cpus_per_rank: int = 1, placement_timeout_s: float | None = None,
                 call_timeout_s: float | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 env_vars: dict[str, str] | None = None, node_spans: list[tuple[int, int]] | None = None,
                 resolved: ResolvedAgent | None = None) -> None:
        if cpus_per_rank < 1:
            raise ValueError(f"cpus_per_rank={cpus_per_rank}: must be >= 1")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}: must be >= 1")
        ray = ensure_ray()
        self.name = agent_cfg.name
        p = agent_cfg.parallel
        self.layout = (p.tp, p.pp, p.cp, p.dp)  # (tp, pp, cp, dp): the world is their product
        self.world_size = agent_cfg.parallel.world_size
        self.call_timeout_s = call_timeout_s
        self.bucket_bytes = int(bucket_bytes)
        self._dead: str | None = None
        self._workers: list[Any] = []
        self._pg: Any = None
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0.0) > 0
        bundle = rank_bundle(use_gpu, cpus_per_rank)
        try:
            timeout = placement_timeout() if placement_timeout_s is None else placement_timeout_s
            envs = self._start(ray, agent_cfg, bundle, timeout, env_vars or {}, node_spans)
            if isinstance(hf_checkpoint, dict):  # one shared-memory copy per node for all its ranks
                hf_checkpoint = ray.put(SharedStateDict.from_tensors(hf_checkpoint))
            refs = [w.setup.remote(WorkerSetup(env, cpus_per_rank, agent_cfg, train_cfg, hf_config, vocab_size, total_updates,
                                               resolved), hf_checkpoint)
                    for w, env in zip(self._workers, envs)]
            results = self._gather(refs, "setup")
        except BaseException:
            self.close()
            raise
        self.infos = [r["info"] for r in results]  # per rank (rank order): models.parallel.ParallelInfo as a dict
        self.push_outcomes: list[PushOutcome] = []  # every rank's part of the last weight push (push_weights)
        self.spec, self.hf_config = results[0]["spec"], results[0]["hf_config"]
        self._num_parameters = int(results[0]["num_parameters"])

    @classmethod
    def from_hf_model(cls, agent_cfg: AgentConfig, hf_model: Any, *, train_cfg: TrainConfig,
                      total_updates: int | None = None, **placement: Any) -> RayAgent:
        """An agent initialised from an in-memory transformers causal LM (its config and weights),
        the weights shipped once via ``ray.put`` as a :class:`SharedStateDict`; ``placement``: see
        the class. For models too large for one host's memory pass ``hf_checkpoint=<HF dir>`` on a
        shared filesystem to the constructor instead: each rank then reads only its own shards."""
        return cls(agent_cfg, train_cfg, hf_checkpoint=dict(hf_model.state_dict()), hf_config=hf_model.config,
                   total_updates=total_updates, **placement)

    # ----------------------------------------------------------------------------------------
    def _start(self, ray: Any, agent_cfg: AgentConfig, bundle: dict[str, float], timeout_s: float,
               env_vars: dict[str, str], node_spans: list[tuple[int, int]] | None) -> list[dict[str, str]]:
        """Placement group (on the planned nodes when ``node_spans`` is given), one actor per bundle,
        ranks ordered by node, rendezvous on rank 0's node; returns each rank's torch.distributed
        environment."""
        self._pg = reserve(ray, agent_cfg, bundle, timeout_s, node_spans)
        actors = spawn_actors(remote_worker_class(ray), self._pg, bundle, self.world_size, env_vars, self.name)
        self._workers = actors  # bundle order until ranks are known (for close on failure)
        infos = self._gather([a.node_info.remote() for a in actors], "start")
        order = rank_order(infos)
        self._workers = [actors[b] for b in order]
        infos = [infos[b] for b in order]
        port = self._gather([self._workers[0].free_port.remote()], "start")[0]
        self.nodes = [info["ip"] for info in infos]
        self.placement = infos  # per rank (rank order): node ip, Ray's GPU ids, pid, host name
        return rank_envs(infos, infos[0]["ip"], port)

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
                self._teardown(f"{what} timed out after {self.call_timeout_s:g} s on ranks {late}")
                raise RayAgentError(f"agent {self.name!r}: {what} did not finish within {self.call_timeout_s:g} s on "
                                    f"ranks {late}; the agent's workers were shut down")
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayTaskError as err:
                cause = err.as_instanceof_cause()
                lost = self._lost_peer_node(ray, str(err.cause))
                self._teardown(f"rank {rank} raised {type(err.cause).__name__} during {what}")
                if lost is not None:  # a surviving rank saw its peer's node go: report the node, not the socket
                    ip, peer = lost
                    raise TrainerNodeLost(f"agent {self.name!r}: node {ip} (rank {peer} of {len(refs)}) left the Ray "
                                          f"cluster during {what}; the agent's workers were shut down") from err
                cause.add_note(f"[hacrl] agent {self.name!r}: raised on rank {rank} during {what}; "
                               "the agent's workers were shut down")
                raise cause from None
            except (RayActorError, GetTimeoutError) as err:
                self._teardown(f"rank {rank} died during {what}")
                ip = self.placement[rank]["ip"] if rank < len(getattr(self, "placement", [])) else None
                if ip is not None and node_left(ray, ip):
                    raise TrainerNodeLost(f"agent {self.name!r}: node {ip} (rank {rank} of {len(refs)}) left the Ray "
                                          f"cluster during {what}; the agent's workers were shut down") from err
                raise RayAgentError(f"agent {self.name!r}: worker of rank {rank}/{len(refs)} died during {what} "
                                    f"({type(err).__name__}: {err}); the agent's workers were shut down") from err
        return results

    def _lost_peer_node(self, ray: Any, error: str) -> tuple[str, int] | None:
        """(node address, first rank there) of a node of this world that left the cluster, when a rank's
        error is a lost peer connection (gloo/NCCL); the cluster notices a dead node within seconds, so
        it is watched for at most :data:`PEER_LOSS_WAIT_S`. None: no lost node (the error is the rank's own)."""
        if not any(marker in error for marker in PEER_LOST_MARKERS):
            return None
        ranks = {info["ip"]: r for r, info in reversed(list(enumerate(getattr(self, "placement", []))))}
        deadline = time.monotonic() + PEER_LOSS_WAIT_S
        while True:
            for ip, rank in sorted(ranks.items(), key=lambda x: x[1]):
                if node_left(ray, ip):
                    return ip, rank
            if time.monotonic() > deadline:
                return None
            time.sleep(1.0)

    def _submit(self, method: Callable[..., R], *args: Any) -> PendingCall[R]:
        """Start the :class:`RankWorker` ``method`` (e.g. ``RankWorker.train``) on every rank; the
        arguments cross the object store once."""
        ray = require_ray()
        self._check_alive()
        arg_refs = [ray.put(a) for a in args]
        name = method.__name__
        return PendingCall(self, [getattr(w, name).remote(*arg_refs) for w in self._workers], name)

    def _call(self, method: Callable[..., R], *args: Any) -> list[R]:
        """Every rank's result of the :class:`RankWorker` ``method``, in rank order."""
        return self._submit(method, *args).results()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise RayAgentError(f"agent {self.name!r} is shut down ({self._dead}); build a new RayAgent")

    # ----------------------------------------------------------------------------------------
    # AgentHandle
    def sequence_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Σ log π of each response [S] (float32, at ``temperature``) and its token count [S]."""
        return self._call(RankWorker.sequence_logprobs, batch, temperature)[0]

    def token_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> LogProbOutput:
        """Per-token log-probs of the responses (packed, see :class:`LogProbOutput`)."""
        return self._call(RankWorker.token_logprobs, batch, temperature)[0]

    def keep_version(self, version: int) -> None:
        """Every rank snapshots its current weight shard as ``version`` (host copy)."""
        self._call(RankWorker.keep_version, version)

    def drop_versions(self, below: int) -> None:
        self._call(RankWorker.drop_versions, below)

    def sequence_logprobs_at(self, version: int, batch: SequenceBatch,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Σ log π of each response under the weights of snapshot ``version``."""
        return self._call(RankWorker.sequence_logprobs_at, version, batch, temperature)[0]

    def keep_reference(self) -> None:
        """Every rank keeps its current weight shard (host copy) as the KL penalty's frozen reference."""
        self._call(RankWorker.keep_reference)

    def reference_token_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> LogProbOutput:
        """Per-token log-probs of the responses under the weights :meth:`keep_reference` kept."""
        return self._call(RankWorker.reference_token_logprobs, batch, temperature)[0]

    def train(self, mini_batches: list[SequenceBatch], loss_fn: LossFn, temperature: float = 1.0) -> list[dict[str, float]]:
        """One optimizer update per mini-batch (m = 0..M−1); ``loss_fn`` is cloudpickled to every rank."""
        return self.train_async(mini_batches, loss_fn, temperature).result()

    def train_async(self, mini_batches: list[SequenceBatch], loss_fn: LossFn,
                    temperature: float = 1.0) -> PendingCall[list[dict[str, float]]]:
        """:meth:`train` started without waiting: agents on disjoint resources then update concurrently
        (``[a.train_async(...) for a in agents]``, then ``.result()`` each). Later calls on the same
        agent queue behind it."""
        return self._submit(RankWorker.train, list(mini_batches), loss_fn, temperature)

    def export_hf_weights(self) -> RayExport:
        """HF-named full tensors (gathered across TP/PP), streamed from rank 0 in ``bucket_bytes`` buckets.

        The next bucket is produced while the caller consumes the current one, so at most two
        buckets are in flight. Abandoning the iterator early is safe: every rank stops on a
        tensor boundary and the next export starts a fresh stream.
        """
        return RayExport(self)

    def _next_bucket(self) -> list[Any]:
        return [w.export_bucket.remote(self.bucket_bytes, r == 0) for r, w in enumerate(self._workers)]

    def _export_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._call(RankWorker.export_begin)
        refs = self._next_bucket()
        while True:
            results = self._gather(refs, "export_hf_weights")
            names, tensors = results[0]
            for rank, (other, _) in enumerate(results[1:], start=1):
                if other != names:
                    self._teardown(f"export streams diverged on rank {rank}")
                    raise RayAgentError(f"agent {self.name!r}: rank {rank} exported {other[:3]}... while rank 0 "
                                        f"exported {names[:3]}...; the agent's workers were shut down")
            if not names:
                return
            refs = self._next_bucket()
            yield from tensors

    # ---- weight push run by the ranks (sync/distributed.py) ------------------------------------
    def open_weight_sender(self, make_sender: Callable[[int], WeightSender]) -> None:
        """Build ``make_sender(rank)`` on every rank (cloudpickled once), replacing the previous senders."""
        self._call(RankWorker.open_weight_sender, make_sender)

    @property
    def pipeline_stages(self) -> int:
        """PP of the agent's layout (a weight transport sends from every stage when it is > 1)."""
        return self.layout[1]

    def push_weights(self, engines: Sequence[Any], version: int) -> int:
        """Every rank exports into its sender, and the senders send to ``engines`` (picklable
        endpoints) as weight version ``version``: rank 0 (``sync/distributed.py``), or each pipeline
        stage's first rank (``sync/stages.py``); returns the number of tensors pushed. Every rank's
        part (tensors, bytes held and sent) stays in :attr:`push_outcomes`.

        A sender's error (a server refused or died) is raised here as it was raised on its rank
        (e.g. ``SGLangUnreachable``; a note names the rank and, for a stage's sender, the stage), and
        the agent stays usable: every rank finished its export.
        """
        outcomes = self._call(RankWorker.push_weights, list(engines), version)
        self.push_outcomes = outcomes
        for rank, outcome in enumerate(outcomes):
            if outcome.error is not None:
                where = f"rank {rank}" + (f" (pipeline {outcome.part})" if outcome.part not in ("all", None) else "")
                outcome.error.add_note(f"[hacrl] agent {self.name!r}: weight push failed on {where}; "
                                       "the agent's world is intact")
                raise outcome.error
        total = push_total(outcomes)
        if total is None:
            counts = [(o.part, o.count) for o in outcomes]
            self._teardown(f"weight push exported {counts} tensors on the ranks")
            raise RayAgentError(f"agent {self.name!r}: ranks exported {counts} (part, tensors) in one weight push; "
                                "the agent's workers were shut down")
        return total

    def close_weight_sender(self) -> None:
        """Close every rank's sender (rank 0 destroys its group with the servers); nothing once shut down."""
        if self._dead is None:
            self._call(RankWorker.close_weight_sender)

    def sleep(self, level: str) -> None:
        """Every rank moves its state to host memory (agents/offload.py): ``optimizer`` or ``all``."""
        self._call(RankWorker.sleep, level)

    def wake(self) -> None:
        """Every rank brings back what :meth:`sleep` moved."""
        self._call(RankWorker.wake)

    def save(self, path: str) -> dict[str, Any]:
        """Model + optimizer + scheduler under ``path`` (every rank writes its shard: a shared filesystem)."""
        self.begin_save(path)
        return self.end_save()

    def begin_save(self, path: str, background: bool = False) -> None:
        """Every rank starts its save; returns once each copied its shard to host memory."""
        self._call(RankWorker.begin_save, str(path), background)

    def end_save(self) -> dict[str, Any]:
        """Every rank finishes the save; each file's size and SHA-256 (every rank returns them all)."""
        return self._call(RankWorker.end_save)[0]

    def load(self, path: str, expected: dict[str, Any] | None = None) -> None:
        """Restore :meth:`save`'s state, possibly written at another TP/PP layout (``expected``: digests)."""
        damaged = [message for message in self._call(RankWorker.load, str(path), expected) if message]
        if damaged:
            raise DigestMismatchError(damaged[0])

    def stats(self) -> dict[str, float]:
        """Rank 0's counters (tokens/s, updates); ``peak_*`` memory is the maximum over ranks."""
        per_rank = self._call(RankWorker.stats)
        out = dict(per_rank[0])
        for key in out:
            if key.startswith("peak_"):
                out[key] = max(float(s.get(key, 0.0)) for s in per_rank)
        out["ranks"] = float(self.world_size)
        return out

    def num_parameters(self) -> int:
        """Parameters of the whole model as HF counts them."""
        return self._num_parameters

    def close(self) -> None:
        """Kill the rank actors and release the placement group (idempotent)."""
        self._teardown("close() was called")

    # ----------------------------------------------------------------------------------------
    def _teardown(self, reason: str) -> None:
        """Kill the rank actors and release the placement group; later calls raise naming ``reason``."""
        if self._dead is not None and not self._workers:
            return
        self._dead = self._dead or reason
        ray = require_ray()
        workers, self._workers = self._workers, []
        try:
            for w in workers:  # a close path: any failure to kill one rank is logged, the others still go
                try:
                    ray.kill(w, no_restart=True)
                except Exception as err:  # noqa: BLE001
                    logger.warning("agent %r: could not kill a rank actor: %s: %s", self.name, type(err).__name__, err)
        finally:
            pg, self._pg = self._pg, None
            if pg is not None:
                release(pg)

    def __enter__(self) -> RayAgent:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def build_ray_agent(agent_cfg: AgentConfig, hf_model: Any, train_cfg: TrainConfig, total_updates: int | None,
                    **placement: Any) -> RayAgent:
    """The trainer's switch (``AgentConfig.workers == "ray"``): a RayAgent from the agent's starting HF model."""
    return RayAgent.from_hf_model(agent_cfg, hf_model, train_cfg=train_cfg, total_updates=total_updates, **placement)
