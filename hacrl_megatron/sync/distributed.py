"""Distributed weight sync: trainer rank 0 broadcasts flattened buckets to every engine rank (NCCL).

What 70B agents need: no disk, no host copy. One process group joins trainer rank 0 (group rank 0)
and every TP rank of every engine of the agent (engine k's ranks start at
``rank_offset = 1 + Σ_{j<k} tp_j``). Per push:

1. every rank of the agent iterates its ``export_hf_weights()`` stream (the TP all-gathers and PP
   broadcasts are collectives on the agent's own groups); rank 0 cuts it into buckets of
   ``bucket_bytes`` (one dtype each, :func:`~hacrl_megatron.sync.base.buckets`);
2. per bucket, rank 0 calls every engine's ``update_weights_from_distributed`` with the names,
   dtypes and shapes (:class:`~hacrl_megatron.rollout.protocol.BroadcastWeightLoader`; each engine
   then allocates the bucket and joins the broadcast), and broadcasts the bucket's bytes — the
   tensors' bytes concatenated in order, no padding
   (:func:`~hacrl_megatron.sync.weight_group.flatten_bucket`);
3. gathering bucket k+1 overlaps the broadcast of bucket k (two buckets in memory); bucket k+1's
   request goes out only after every engine answered bucket k, so requests can never overtake
   each other on the server. Only the last bucket flushes the servers' prefix caches.

Where rank 0 runs: a :class:`~hacrl_megatron.agents.local.LocalAgent` world calls
:func:`push_from_rank` on each of its ranks. A transport built with ``ranks`` (a Ray agent,
:class:`RankSource`; ``trainer/runtime.py`` does so for Ray agents) has that agent's own ranks push:
it gives every rank a :class:`RankSender` (rank 0's holds a transport), so trainer rank 0's process
is group rank 0, the group's master address is on rank 0's node, and rank 0 also sends the
per-bucket requests (they carry the bucket's names and shapes, which only rank 0 knows, and each
blocks on the engine while that bucket's broadcast runs). The controller only starts the push; no
tensor passes through it. A Ray agent with PP > 1 pushes from every stage instead
(``sync/stages.py``: one group per stage, the stages' senders taking turns, :class:`BucketTurns`).

The group is created through each engine's ``init_weights_update_group`` (for SGLang: its
rendezvous, ``init_method = tcp://master:port``, the store prefixed by the group name, torch's
process-group helper): :func:`~hacrl_megatron.sync.weight_group.init_weight_group` is the trainer's
side of that protocol. A server restart breaks the group; the next push destroys it everywhere and
creates a new one.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from hacrl_megatron.net import free_port, node_address_towards
from hacrl_megatron.rollout.protocol import BroadcastWeightLoader, EngineError, EngineUnreachable
from hacrl_megatron.sync.base import (
    DaemonCall,
    NamedTensors,
    RankSenders,
    buckets,
    on_all,
    tensor_bytes,
    weight_update_session,
    with_last,
)
from hacrl_megatron.sync.nccl_version import Version, check_nccl_versions, engine_versions
from hacrl_megatron.sync.weight_group import (
    broadcast_async,
    destroy_weight_group,
    flatten_bucket,
    init_weight_group,
)

_GROUP_IDS = itertools.count()


# --------------------------------------------------------------------------------------------
# the transport


ABANDON_GRACE_S = 30.0  # a failed push: how long the other members get to finish or leave the group


@runtime_checkable
class BucketTurns(Protocol):
    """Turns on the engines shared by several senders (``sync/stages.py``: one per pipeline stage).

    An engine takes one weight request at a time, and every engine of the agent is a member of
    every sender's group: two senders' buckets on the wire at once could leave engine A in one
    group's broadcast waiting for engine B while B waits in the other for A. A sender therefore
    holds a turn while its group forms and while each of its buckets is on the wire; it prepares
    its next bucket outside the turn."""

    def acquire(self) -> None:
        """Wait for this sender's turn (no-op while it holds one)."""

    def release(self) -> None:
        """Give the turn to the next sender waiting (no-op while it holds none)."""


class _NoTurns:
    """The engines' only sender: always its turn."""

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass


NO_TURNS = _NoTurns()


def check_answering(engines: Sequence[BroadcastWeightLoader], group_name: str) -> None:
    """Raise :class:`~hacrl_megatron.rollout.protocol.EngineUnreachable` naming the engines that
    fail their health check.

    A member that cannot take part would leave the others blocked in the rendezvous or in a
    bucket's broadcast (a real server's scheduler with them) until the group's timeout; a
    server dying during the push itself still does that.
    """
    down = [e.base_url for e, up in zip(engines, on_all(engines, lambda e: bool(e.health()))) if not up]
    if down:
        raise EngineUnreachable(f"weight group {group_name!r}: {', '.join(down)} fail(s) the health "
                                "check; not broadcasting to a group that cannot complete")


@dataclass
class _InFlight:
    requests: list[DaemonCall]
    work: Any
    flat: torch.Tensor  # kept alive until the broadcast completed


class DistributedTransport(RankSenders):
    """Args:
        bucket_bytes: bytes per broadcast (``rollout.weight_sync_bucket_mb``).
        backend: "nccl", "gloo", or "auto" (nccl when this process has CUDA, else gloo: a trainer
            without a GPU still reaches GPU servers, over TCP).
        group_name: prefix of the group's name (one group per agent: include the agent's name).
        master_address: the address engines reach this process at, and the only one its store and
            gloo sockets listen on (default: ``net.node_address_towards`` the first engine: this
            node's address in a Ray cluster, else the interface that routes to the engine).
        timeout_s: rendezvous and per-bucket timeout.
        ranks: an agent whose own ranks push (a Ray agent, :class:`RankSource`): each push then has
            that agent's ranks export and rank 0 broadcast; the stream given to :meth:`push` must be
            that agent's export (``stream.ranks is ranks``) and is not read (the ranks export the same
            weights themselves). None: this process broadcasts the stream it is given.
        engine_nccl: the engines' NCCL versions ({base_url: version}) read where their server handles
            are, for a group opened elsewhere (a Ray agent's rank 0); other engines are read here.
            An nccl group opens only when every known version equals this process's
            (``sync/nccl_version.py``).
        sessions: open every engine's weight-update session around the push (False: whoever runs
            the push holds them, as the controller of a stage-parallel push does, ``sync/stages.py``).
        turns: held while this transport's group forms and while each of its buckets is on the wire
            (:class:`BucketTurns`); None: this transport is the engines' only sender.
    """

    name = "distributed"
    engine_protocol = BroadcastWeightLoader

    def __init__(self, bucket_bytes: int = 512 << 20, *, backend: str = "auto", group_name: str = "hacrl_weights",
                 master_address: str | None = None, timeout_s: float = 600.0, ranks: RankSource | None = None,
                 engine_nccl: dict[str, Version | None] | None = None, sessions: bool = True,
                 turns: BucketTurns | None = None) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"DistributedTransport: bucket_bytes={bucket_bytes} must be >= 1")
        if backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"DistributedTransport: backend={backend!r} must be auto, nccl or gloo")
        self.bucket_bytes = bucket_bytes
        self.backend_choice = backend  # what a rank-side copy resolves in its own process (its GPU)
        self.backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
        self.group_name = group_name
        self.master_address = master_address
        self.timeout_s = timeout_s
        self._group: Any = None
        self._group_id = ""
        self._members: list[BroadcastWeightLoader] = []
        self._stale = False  # a member restarted or a broadcast failed: rebuild before the next push
        self.ranks = ranks
        self.engine_nccl = dict(engine_nccl or {})
        self._senders_open = False  # the ranks hold this transport's senders (opened at the first push)
        self.sessions = sessions
        self.turns: BucketTurns = turns or NO_TURNS
        self.buckets_sent = 0
        self.bytes_sent = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    # ---- group lifetime --------------------------------------------------------------------
    def _ensure_group(self, engines: Sequence[BroadcastWeightLoader]) -> None:
        key = [(e.base_url, e.tp_size) for e in engines]
        if self._group is not None and not self._stale and key == [(e.base_url, e.tp_size) for e in self._members]:
            return
        self._close_group()
        if self.backend == "nccl":  # NCCL refuses ranks of different versions: say so before the rendezvous
            check_nccl_versions(self.group_name, engines, self.engine_nccl)
        address = self.master_address or node_address_towards(engines[0].base_url)
        port, world = free_port(""), 1 + sum(e.tp_size for e in engines)
        self._group_id = f"{self.group_name}-{os.getpid()}-{next(_GROUP_IDS)}"
        offsets = [1 + sum(e.tp_size for e in engines[:k]) for k in range(len(engines))]
        joined: dict[str, Any] = {}

        def join() -> None:  # a daemon thread: a server that refused the group must not hang this process
            try:
                joined["group"] = init_weight_group(address, port, 0, world, self._group_id, self.backend,
                                                    self.timeout_s)
            except BaseException as e:  # noqa: BLE001  (re-raised below in the caller's thread)
                joined["error"] = e

        local = threading.Thread(target=join, daemon=True, name="weight-group-rank0")
        with ThreadPoolExecutor(max_workers=len(engines)) as pool:
            # each server blocks in the rendezvous until rank 0 (the thread above) joins
            futures = [pool.submit(e.init_weights_update_group, master_address=address, master_port=port,
                                   rank_offset=off, world_size=world, group_name=self._group_id, backend=self.backend)
                       for e, off in zip(engines, offsets)]
            local.start()
            while local.is_alive():
                failed = [f for f in futures if f.done() and f.exception() is not None]
                if failed:  # e.g. the server cannot use the backend: fail now, not after the rendezvous timeout
                    raise failed[0].exception()
                local.join(timeout=0.05)
            if "error" in joined:
                raise joined["error"]
            for f in futures:
                f.result()
        self._group, self._members, self._stale = joined["group"], list(engines), False

    def close(self) -> None:
        """Destroy the group on every member still reachable and here (errors of dead members
        ignored), and the senders on an agent's ranks."""
        self._close_ranks()
        self._close_group()

    def _close_group(self) -> None:
        if self._group is None:
            return
        for engine in self._members:
            try:
                engine.destroy_weights_update_group(self._group_id)
            except Exception:  # noqa: BLE001  (a dead or restarted server has no group left to destroy)
                pass
        destroy_weight_group(self._group)
        self._group, self._members = None, []

    def restore(self, engine: BroadcastWeightLoader, version: int) -> bool:
        """A restarted server left the group: the next push rebuilds it; until then it waits."""
        self._stale = True
        return False

    def _check_answering(self, engines: Sequence[BroadcastWeightLoader]) -> None:
        check_answering(engines, self.group_name)

    # ---- one push --------------------------------------------------------------------------
    def _launch(self, engines: Sequence[BroadcastWeightLoader], flat: torch.Tensor, meta: dict[str, list],
                last: bool, version: int) -> _InFlight:
        requests = [DaemonCall(e, functools.partial(e.update_weights_from_distributed, **meta, group_name=self._group_id,
                                                  flush_cache=last, version=version), "bucket")
                    for e in engines]
        return _InFlight(requests, broadcast_async(self._group, flat), flat)

    def _finish(self, inflight: _InFlight) -> None:
        """Wait for the broadcast and every engine's reply; a failed engine ends the push at once
        (:meth:`_abandon`: the group is then taken down and rebuilt at the next push)."""
        deadline = time.monotonic() + self.timeout_s
        while not inflight.work.is_completed():
            failed = [r for r in inflight.requests if r.failed]
            if failed:
                self._abandon(inflight, failed)
            if time.monotonic() > deadline:
                self._abandon(inflight, [], f"the broadcast did not finish within {self.timeout_s:.0f} s")
            time.sleep(0.0005)
        try:
            inflight.work.wait()
        except Exception as e:  # noqa: BLE001  (a member's sockets closed: reported with the engines' replies)
            self._abandon(inflight, [r for r in inflight.requests if r.failed], f"the broadcast failed: {e}")
        for r in inflight.requests:
            r.done.wait(timeout=max(0.0, deadline - time.monotonic()))
        if any(not r.done.is_set() or r.failed for r in inflight.requests):
            self._abandon(inflight, [r for r in inflight.requests if r.failed],
                          "" if any(r.failed for r in inflight.requests)
                          else f"an engine did not answer within {self.timeout_s:.0f} s")

    def _abandon(self, inflight: _InFlight, failed: list[DaemonCall], why: str = "") -> None:
        """End a failed push without leaving the trainer's side of the broadcast outstanding, then raise.

        An engine that refused its bucket never joined the broadcast, so rank 0's send to its ranks
        would wait for the group's timeout: every member is asked to leave the group (the refusing
        engine's ranks are free to, which closes their gloo sockets and fails that send at once), an
        nccl communicator is aborted, and the other engines' requests get :data:`ABANDON_GRACE_S` to
        finish. The error names the failing engines (class of the first one's error, so a dead server
        reads as :class:`~hacrl_megatron.rollout.protocol.EngineUnreachable`) and what became of the others.
        """
        group, members, group_id = self._group, self._members, self._group_id
        self._group, self._members, self._stale = None, [], True
        if self.backend == "nccl" and hasattr(group, "abort"):
            try:
                group.abort()
            except Exception:  # noqa: BLE001  (already torn down)
                pass
        leaving = [DaemonCall(e, functools.partial(e.destroy_weights_update_group, group_id), "leave") for e in members]
        deadline = time.monotonic() + min(ABANDON_GRACE_S, self.timeout_s)
        while not inflight.work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
        for r in inflight.requests + leaving:
            r.done.wait(timeout=max(0.0, deadline - time.monotonic()))
        try:
            destroy_weight_group(group)
        except Exception:  # noqa: BLE001  (a broken nccl communicator may refuse; it is dropped either way)
            pass
        failed = failed or [r for r in inflight.requests if r.failed]
        names = ", ".join(f"engine {r.engine.name} ({r.engine.base_url})" for r in failed) or "the engines"
        causes = "; ".join(f"{r.engine.name}: {r.error}" for r in failed)
        others = "; ".join(f"{r.engine.name}: {r.outcome()}" for r in inflight.requests if r not in failed)
        message = (f"weight group {self.group_name!r}: push failed at {names}"
                   + (f": {why}" if why else "") + (f" ({causes})" if causes else "")
                   + (f"; the other engines' bucket requests: {others}" if others else "")
                   + "; the group was taken down on every member and is rebuilt at the next push")
        first = failed[0].error if failed else None
        cls = type(first) if isinstance(first, EngineError) else EngineError
        try:
            error = cls(message)
        except TypeError:
            error = EngineError(message)
        raise error from first

    def push(self, engines: Sequence[BroadcastWeightLoader], named_tensors: NamedTensors, version: int) -> int:
        """Broadcast ``named_tensors`` from this process, or, for a transport built with ``ranks``,
        have that agent's ranks export and broadcast (:meth:`_push_from_ranks`): the stream must then
        be that agent's own export (its ``ranks``), which is not read; any other stream is refused
        rather than replaced by the agent's weights."""
        if not engines:
            raise ValueError("DistributedTransport.push: no engines")
        if self.ranks is not None:
            if getattr(named_tensors, "ranks", None) is not self.ranks:
                raise ValueError(f"DistributedTransport {self.group_name!r}: the agent's ranks send their own export; "
                                 "tensors from elsewhere need a transport built without ranks")
            return self._push_from_ranks(engines, version)
        self._check_answering(engines)
        try:
            self.turns.acquire()  # every engine joins this group: no other sender's group may form or send meanwhile
            self._ensure_group(engines)
            self.turns.release()
            count, inflight = 0, None
            # every engine's session opens before the first broadcast starts (a server refuses a bucket
            # outside it) and closes after the last, also when one failed
            with weight_update_session(engines) if self.sessions else contextlib.nullcontext():
                for bucket, last in with_last(buckets(named_tensors, self.bucket_bytes)):
                    flat, meta = flatten_bucket(bucket, self.device)  # gathering this bucket overlapped the last broadcast
                    if inflight is not None:
                        self._finish(inflight)
                        self.turns.release()
                    self.turns.acquire()
                    inflight = self._launch(engines, flat, meta, last, version)
                    count += len(bucket)
                    self.buckets_sent += 1
                    self.bytes_sent += sum(tensor_bytes(t) for _, t in bucket)
                if inflight is not None:
                    self._finish(inflight)
        finally:
            self.turns.release()
        if count == 0:
            raise ValueError("DistributedTransport.push: no tensors given")
        return count

    # ---- pushes run by an agent's own ranks -------------------------------------------------
    def _push_from_ranks(self, engines: Sequence[BroadcastWeightLoader], version: int) -> int:
        """Every rank of ``self.ranks`` exports; its rank 0 joins the group and broadcasts (module
        docstring). The engines travel to the ranks as detached clients (``detached()``).

        The senders are opened once and keep their group between pushes; a restarted server or a
        failed push (``_stale``) opens fresh ones, whose rank 0 rebuilds the group.
        """
        def factory() -> RankSenderFactory:
            # the engines' NCCL is read here, where their server handles are; rank 0 compares its own
            versions = engine_versions(engines) if self.backend_choice != "gloo" else {}
            return RankSenderFactory(self.bucket_bytes, self.backend_choice, self.group_name, self.master_address,
                                     self.timeout_s, versions)

        return self._push_through_ranks(engines, version, factory)


def push_from_rank(named_tensors: NamedTensors, transport: DistributedTransport | None,
                   engines: Sequence[BroadcastWeightLoader] = (), version: int = 0) -> int:
    """Run on every rank of an agent with that rank's own export stream (a collective): rank 0
    passes its transport and the engines and broadcasts; the other ranks pass None and only
    advance the stream in step. Returns the number of tensors.

    When rank 0's push fails (a server refused or died), rank 0 still runs the rest of its export
    before re-raising, so that the other ranks' gathers complete and the agent's world stays usable.
    """
    if transport is None:
        return sum(1 for _ in named_tensors)
    stream = iter(named_tensors)
    try:
        return transport.push(engines, stream, version)
    except Exception:
        for _ in stream:  # the remaining collectives, in step with the other ranks (a generator
            pass  # that raised itself is finished: nothing left to run)
        raise


# --------------------------------------------------------------------------------------------
# the rank side of a push run by a Ray agent's ranks


@runtime_checkable
class RankSource(Protocol):
    """An agent whose ranks can run a push themselves
    (:class:`~hacrl_megatron.agents.ray_agent.RayAgent`)."""

    def open_weight_sender(self, make_sender: Callable[[int], RankSender]) -> None:
        """Build ``make_sender(rank)`` on every rank (replacing and closing the previous ones)."""

    def push_weights(self, engines: Sequence[BroadcastWeightLoader], version: int) -> int:
        """Every rank feeds its export into its sender; the number of tensors. Raises the sender's
        error (e.g. :class:`~hacrl_megatron.rollout.protocol.EngineUnreachable`) with the agent still usable."""

    def close_weight_sender(self) -> None:
        """Close the senders (rank 0 destroys the group)."""


@dataclass
class RankSender:
    """One rank's side of a push run by the agent's ranks: rank 0 holds the transport, the others
    None (:func:`push_from_rank`). Lives on its rank between pushes, so the group persists."""

    transport: DistributedTransport | None
    last_bytes_sent: int = 0  # bucket bytes this rank broadcast in its last push (rank 0: the whole model)

    def push(self, named_tensors: NamedTensors, engines: Sequence[BroadcastWeightLoader], version: int) -> int:
        before = self.transport.bytes_sent if self.transport is not None else 0
        try:
            return push_from_rank(named_tensors, self.transport, engines, version)
        finally:
            self.last_bytes_sent = self.transport.bytes_sent - before if self.transport is not None else 0

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


@dataclass(frozen=True)
class RankSenderFactory:
    """Builds each rank's :class:`RankSender` on that rank (pickled to the ranks; ``backend``
    "auto" is resolved there: nccl where rank 0 has a GPU)."""

    bucket_bytes: int
    backend: str
    group_name: str
    master_address: str | None
    timeout_s: float
    engine_nccl: dict[str, Version | None] | None = None  # {base_url: NCCL version} read by the controller

    def __call__(self, rank: int) -> RankSender:
        if rank != 0:
            return RankSender(None)
        return RankSender(DistributedTransport(self.bucket_bytes, backend=self.backend, group_name=self.group_name,
                                               master_address=self.master_address, timeout_s=self.timeout_s,
                                               engine_nccl=self.engine_nccl))
