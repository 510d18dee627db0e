"""``rollout.weight_sync: distributed`` from every pipeline stage at once (a Ray agent with PP > 1).

The rank-0 path (``sync/distributed.py``) funnels the whole model through trainer rank 0: every
tensor is gathered over TP on its stage, broadcast over the pipeline group to every other stage
(``models/export.export_hf_weights``), and rank 0 alone broadcasts the buckets to the engines: for a
70B agent, 140 GB into and out of one rank per step and P − 1 extra copies of the model on the
trainer's links. Here each stage sends its own share (docs/weight_sync.md):

- **who sends**: each stage's first TP rank of data-parallel replica 0 (:class:`StageRole`). It and
  its TP peers iterate ``export_stage_hf_weights`` (each parameter's TP shards gathered within the
  stage, converted to HF tensors; no pipeline traffic). A gather within the stage, not a shard per
  rank, because the engines' protocol carries HF tensors and their TP layout is not the trainer's:
  a TP-sharded weight (QKV grouped per KV head, the padded vocabulary) is an HF tensor only once
  its shards are together, and the gather stays on the stage's NVLink. The other replicas hold the
  same weights and take no part (with MoE and EP > 1 every rank of a stage exports: its experts
  are broadcast over EP groups that span the replicas).
- **groups**: one weight group per stage, formed like the rank-0 path's: the stage's sender is
  group rank 0 and hosts the group's store on its own node, every engine rank joins (ranks 1 …
  Σ tp), so each engine is in P groups (SGLang keeps weight-update groups by name) and the
  protocol per bucket is unchanged: ``update_weights_from_distributed`` with the bucket's names,
  dtypes and shapes, the bytes broadcast from group rank 0. An engine loads each bucket by name:
  the buckets of all stages together are the whole HF state dict, assembled on the engine.
- **turns**: an engine takes one weight request at a time, and all engines are in every stage's
  group, so two stages' buckets on the wire at once can deadlock (engine A in stage 0's broadcast
  waiting for engine B, B in stage 1's waiting for A). The senders take turns on the engines
  (:class:`StageTurns`, first come first served, a ticket lock in the agent world's own store:
  a few bytes per bucket): a sender holds a turn while its group forms and while one bucket is on
  the wire, and gathers and flattens its next bucket while the other stages send theirs.
- **the controller** (:class:`StageTransport`) checks every engine's health and opens its
  weight-update session before any stage sends and closes it after every stage finished; each
  stage's last bucket flushes the engines' cache (idempotent: the last one leaves it clean).

A failure on a stage is raised naming the stage and the trainer rank (:func:`stage_failure`), with
the agent's world intact (every rank ran its export to the end); the next push builds new senders.
"""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hacrl_megatron.rollout.protocol import BroadcastWeightLoader, EngineError
from hacrl_megatron.sync.base import NamedTensors, RankSenders, weight_update_session
from hacrl_megatron.sync.distributed import DistributedTransport, check_answering, push_from_rank
from hacrl_megatron.sync.nccl_version import Version, engine_versions

__all__ = ["StageRole", "StageSender", "StageSenderFactory", "StageTransport", "StageTurns", "stage_failure",
           "stage_roles", "world_store"]


@dataclass(frozen=True)
class StageRole:
    """One trainer rank's part in a stage-parallel push.

    rank: the rank in the agent's world. stage, stages: its pipeline stage and the agent's PP.
    sends: it sends its stage's tensors to the engines (one rank per stage).
    exports: it iterates its stage's export (the sender and its TP peers, or every rank of the
        stage for MoE with EP > 1); False: it holds a copy the sender's replica also holds.
    """

    rank: int
    stage: int
    stages: int
    sends: bool
    exports: bool

    @property
    def part(self) -> str | None:
        """What this rank's export covers in :class:`~hacrl_megatron.agents.ray_worker.PushOutcome`."""
        return f"stage{self.stage}" if self.exports else None

    def __str__(self) -> str:
        return f"pipeline stage {self.stage} of {self.stages} (trainer rank {self.rank})"


def stage_roles(infos: Sequence[Mapping[str, int]]) -> tuple[StageRole, ...]:
    """Every rank's role from the ranks' layouts (``models.parallel.ParallelInfo`` as dicts, in rank
    order, as :attr:`RayAgent.infos` holds them). Raises ValueError unless each stage has one sender."""
    roles = tuple(StageRole(rank, int(i["pp_rank"]), int(i["pp"]), sends=i["tp_rank"] == 0 and i["dp_rank"] == 0,
                            exports=i["dp_rank"] == 0 or int(i.get("ep", 1)) > 1)
                  for rank, i in enumerate(infos))
    if not roles or sorted(r.stage for r in roles if r.sends) != list(range(roles[0].stages)):
        raise ValueError(f"stage_roles: the layouts {list(infos)} do not give one sender per pipeline stage")
    return roles


def stage_failure(error: BaseException, role: StageRole) -> BaseException:
    """``error`` re-made with the failing stage and rank in front (the same class where it takes one
    message, so that a dead server still reads as :class:`~hacrl_megatron.rollout.protocol.EngineUnreachable`)."""
    message = f"{role}: {error}"
    try:
        return type(error)(message)
    except Exception:  # noqa: BLE001  (an error class with another signature: the message says what it was)
        return EngineError(f"{message} ({type(error).__name__})")


# --------------------------------------------------------------------------------------------
# turns on the engines


def world_store() -> Any:
    """The key-value store of this rank's agent world (``torch.distributed``'s default group: the
    rendezvous store every rank already reaches)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


class StageTurns:
    """The stage senders' :class:`~hacrl_megatron.sync.distributed.BucketTurns`: a first-come
    first-served ticket lock in a store all of them reach (``store.add`` hands out tickets, each
    release sets the key the next ticket waits on). Tickets keep counting across pushes, so one set
    of senders (one ``prefix``) never resets them.

    ``timeout_s`` bounds one wait (the other stages' buckets in between); ``waited_s`` sums the
    waits (benchmarks). A sender that dies holding a turn leaves the others to time out: the push
    fails, and the next one builds new senders with a new prefix.
    """

    def __init__(self, store: Any, prefix: str, timeout_s: float) -> None:
        self.store, self.prefix = store, prefix
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.ticket = 0  # the ticket held now (0: none)
        self.waited_s = 0.0

    def acquire(self) -> None:
        if self.ticket:
            return
        ticket = int(self.store.add(f"{self.prefix}/tickets", 1))
        if ticket > 1:
            key, start = f"{self.prefix}/go/{ticket}", time.monotonic()
            try:
                self.store.wait([key], self.timeout)
            except Exception as e:  # noqa: BLE001  (torch raises its own store errors; say what waited)
                raise TimeoutError(f"weight turns {self.prefix!r}: turn {ticket} did not come within "
                                   f"{self.timeout.total_seconds():.0f} s (another stage's sender holds the engines, "
                                   f"or died): {e}") from e
            self.store.delete_key(key)
            self.waited_s += time.monotonic() - start
        self.ticket = ticket

    def release(self) -> None:
        if self.ticket:
            self.store.set(f"{self.prefix}/go/{self.ticket + 1}", "1")
            self.ticket = 0


# --------------------------------------------------------------------------------------------
# the rank side


class StageSender:
    """One rank's :class:`~hacrl_megatron.agents.ray_worker.WeightSender` in a stage-parallel push.

    Built on its rank by :class:`StageSenderFactory` and kept between pushes, so that a stage's
    group persists. A sending rank pushes its stage's stream through ``make_transport(role)``'s
    transport (a :class:`~hacrl_megatron.sync.distributed.DistributedTransport` of its stage's group,
    built at its first push); the other exporting ranks only advance their stage's collectives.
    """

    def __init__(self, role: StageRole, make_transport: Callable[[StageRole], Any]) -> None:
        self.role = role
        self._make_transport = make_transport
        self.transport: Any = None
        self.last_bytes_sent = 0  # bucket bytes this rank broadcast in its last push: its stage's share

    @property
    def export(self) -> str:
        """The stream the rank feeds this sender (``agents/ray_worker.EXPORTS``)."""
        return "stage" if self.role.exports else "none"

    @property
    def part(self) -> str | None:
        return self.role.part

    def push(self, named_tensors: NamedTensors, engines: Sequence[Any], version: int) -> int:
        """Send this rank's stage stream (a sender) or advance it (the others); the stream's tensors."""
        if not self.role.sends:
            return sum(1 for _ in named_tensors)
        if self.transport is None:
            self.transport = self._make_transport(self.role)
        before = self.transport.bytes_sent
        try:
            return push_from_rank(named_tensors, self.transport, engines, version)
        except Exception as error:
            raise stage_failure(error, self.role) from error
        finally:
            self.last_bytes_sent = self.transport.bytes_sent - before

    def close(self) -> None:
        transport, self.transport = self.transport, None
        if transport is not None:
            transport.close()


@dataclass(frozen=True)
class StageSenderFactory:
    """Builds each rank's :class:`StageSender` on that rank (pickled to the ranks; ``backend`` "auto"
    is resolved there: nccl where the sender has a GPU).

    ``turns_key``: the store prefix of these senders' turns (unique per factory); ``store``: the store
    the turns live in, called on the sending rank (a module-level function: it pickles by name).
    """

    roles: tuple[StageRole, ...]
    bucket_bytes: int
    backend: str
    group_name: str
    master_address: str | None
    timeout_s: float
    engine_nccl: dict[str, Version | None] | None
    turns_key: str
    store: Callable[[], Any] = world_store

    def __call__(self, rank: int) -> StageSender:
        return StageSender(self.roles[rank], self.transport)

    def turns(self, role: StageRole) -> StageTurns:
        # a turn waits for at most every other stage's bucket (or group) in between
        return StageTurns(self.store(), self.turns_key, self.timeout_s * role.stages)

    def transport(self, role: StageRole) -> DistributedTransport:
        return DistributedTransport(self.bucket_bytes, backend=self.backend, group_name=f"{self.group_name}-stage{role.stage}",
                                    master_address=self.master_address, timeout_s=self.timeout_s,
                                    engine_nccl=self.engine_nccl, sessions=False, turns=self.turns(role))


# --------------------------------------------------------------------------------------------
# the controller's side


class StageTransport(RankSenders):
    """The weight transport of a stage-parallel push (module docstring), run from the controller.

    Args:
        bucket_bytes, backend, group_name, master_address, timeout_s: as for
            :class:`~hacrl_megatron.sync.distributed.DistributedTransport`; each stage's group is named
            ``<group_name>-stage<k>``.
        ranks: the agent whose ranks push (:class:`~hacrl_megatron.agents.ray_agent.RayAgent`: its
            ``infos`` give each rank's stage, and ``open_weight_sender`` / ``push_weights`` /
            ``close_weight_sender`` run the senders). The stream given to :meth:`push` must be that
            agent's export and is not read.
        store: where the senders take turns, called on each sending rank (default: the agent world's
            store, :func:`world_store`; a module-level function, it pickles by name).
    """

    name = "distributed"
    engine_protocol: type = BroadcastWeightLoader

    def __init__(self, bucket_bytes: int = 512 << 20, *, ranks: Any, backend: str = "auto",
                 group_name: str = "hacrl_weights", master_address: str | None = None, timeout_s: float = 600.0,
                 store: Callable[[], Any] = world_store) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"{type(self).__name__}: bucket_bytes={bucket_bytes} must be >= 1")
        if backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"{type(self).__name__}: backend={backend!r} must be auto, nccl or gloo")
        self.bucket_bytes, self.backend, self.group_name = bucket_bytes, backend, group_name
        self.master_address, self.timeout_s = master_address, timeout_s
        self.ranks, self.store = ranks, store
        self.roles = stage_roles(ranks.infos)
        self._senders_open = False
        self._stale = False  # a server restarted or a push failed: new senders (new groups) at the next push

    def _factory(self, engines: Sequence[Any]) -> Callable[[int], Any]:
        versions = engine_versions(engines) if self.backend != "gloo" else {}  # read where the server handles are
        return StageSenderFactory(self.roles, self.bucket_bytes, self.backend, self.group_name, self.master_address,
                                  self.timeout_s, versions, f"hacrl_weight_turns/{self.group_name}/{uuid.uuid4().hex}",
                                  self.store)

    @contextmanager
    def _update(self, engines: Sequence[Any], version: int) -> Iterator[None]:
        """Around every stage's buckets: each engine's weight-update session."""
        with weight_update_session(engines):
            yield

    def push(self, engines: Sequence[Any], named_tensors: NamedTensors, version: int) -> int:
        """Have every stage of ``self.ranks`` send its share into ``engines`` as weight version
        ``version``; the number of tensors of all stages together."""
        if not engines:
            raise ValueError(f"{type(self).__name__}.push: no engines")
        if getattr(named_tensors, "ranks", None) is not self.ranks:
            raise ValueError(f"{type(self).__name__} {self.group_name!r}: the agent's stages send their own export; "
                             "tensors from elsewhere need a transport built without ranks")
        check_answering(engines, self.group_name)
        try:
            with self._update(engines, version):
                return self._push_through_ranks(engines, version, lambda: self._factory(engines))
        except BaseException:  # the session's opening or closing too: new groups at the next push
            self._stale = True
            raise

    def restore(self, engine: Any, version: int) -> bool:
        """A restarted server left the groups: the next push builds them anew; until then it waits."""
        self._stale = True
        return False

    def close(self) -> None:
        """Close the senders on the agent's ranks (each destroys its stage's group on every engine)."""
        self._close_ranks()

