"""``rollout.weight_sync: distributed`` for vLLM servers from every pipeline stage (a Ray agent with PP > 1).

CUDA only (vLLM's NCCL weight transfer); written against vLLM 0.32's ``nccl_engine.py`` and not yet
run on GPUs in this project's CI (docs/weight_sync.md, "What is not verified").

vLLM's weight-transfer engine keeps one NCCL communicator per server, and its packed consumer
receives every chunk from that communicator's rank 0: unlike SGLang (``sync/stages.py``: one group
per stage, kept by name) a server cannot hold one group per stage. So each stage's sender, in its
turn (:class:`~hacrl_megatron.sync.stages.StageTurns`, one turn for its whole share), opens the
servers' transfer with itself as rank 0 (a fresh ``ncclUniqueId``, ``init_weight_transfer``), sends
its stage's chunks (``update_weights``; the stage's tensors TP-gathered within the stage only) and
shuts the transfer down. The controller brackets the whole push with ``start_weight_update`` …
``finish_weight_update(version)`` on every server, so that the servers finalise once, with every
stage's weights loaded.

Per push that is P communicator set-ups instead of one, and the stages' sends follow each other
rather than interleave: what it buys is that no trainer rank gathers, holds or sends more than its
own stage's share, where the rank-0 path (``sync/vllm_nccl.py`` with ``ranks``) first broadcasts the
whole model over the pipeline group to every stage.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hacrl_megatron.rollout.protocol import WeightTransferReceiver
from hacrl_megatron.sync.base import NamedTensors, on_all
from hacrl_megatron.sync.distributed import push_from_rank
from hacrl_megatron.sync.nccl_version import Version, engine_versions
from hacrl_megatron.sync.stages import (
    StageRole,
    StageSender,
    StageTransport,
    StageTurns,
    stage_failure,
    world_store,
)
from hacrl_megatron.sync.vllm_nccl import VLLMNCCLTransport


class VLLMStageSender(StageSender):
    """A stage's sender for vLLM servers: a fresh transfer (its own communicator) in each push, held
    for the whole of its stage's share (module docstring)."""

    def __init__(self, role: StageRole, factory: VLLMStageSenderFactory) -> None:
        super().__init__(role, factory.transport)
        self._turns = factory.turns(role) if role.sends else None

    def push(self, named_tensors: NamedTensors, engines: Sequence[Any], version: int) -> int:
        if not self.role.sends:
            return sum(1 for _ in named_tensors)
        assert self._turns is not None
        self._turns.acquire()  # the servers' one communicator is this stage's until it is shut down
        transport = self._make_transport(self.role)
        try:
            return push_from_rank(named_tensors, transport, engines, version)
        except Exception as error:
            raise stage_failure(error, self.role) from error
        finally:
            self.last_bytes_sent = transport.bytes_sent
            try:
                transport.close()  # the servers' transfer engine too: the next stage opens its own
            finally:
                self._turns.release()


@dataclass(frozen=True)
class VLLMStageSenderFactory:
    """Builds each rank's :class:`VLLMStageSender` on that rank (pickled to the ranks)."""

    roles: tuple[StageRole, ...]
    bucket_bytes: int
    timeout_s: float
    engine_nccl: dict[str, Version | None] | None
    turns_key: str
    store: Callable[[], Any] = world_store

    def __call__(self, rank: int) -> VLLMStageSender:
        return VLLMStageSender(self.roles[rank], self)

    def turns(self, role: StageRole) -> StageTurns:
        return StageTurns(self.store(), self.turns_key, self.timeout_s * role.stages)

    def transport(self, role: StageRole) -> VLLMNCCLTransport:
        return VLLMNCCLTransport(self.bucket_bytes, timeout_s=self.timeout_s, engine_nccl=self.engine_nccl, updates=False)


class VLLMStageTransport(StageTransport):
    """:class:`~hacrl_megatron.sync.stages.StageTransport` for vLLM servers (module docstring)."""

    engine_protocol = WeightTransferReceiver

    def __init__(self, bucket_bytes: int = 512 << 20, *, ranks: Any, timeout_s: float = 600.0,
                 store: Callable[[], Any] = world_store) -> None:
        super().__init__(bucket_bytes, ranks=ranks, backend="nccl", group_name="vllm", timeout_s=timeout_s, store=store)

    def _factory(self, engines: Sequence[Any]) -> Callable[[int], Any]:
        return VLLMStageSenderFactory(self.roles, self.bucket_bytes, self.timeout_s, engine_versions(engines),
                                      f"hacrl_weight_turns/vllm/{uuid.uuid4().hex}", self.store)

    @contextmanager
    def _update(self, engines: Sequence[Any], version: int) -> Iterator[None]:
        """Around every stage's chunks: one update on every server, finished as ``version``."""
        on_all(engines, lambda e: e.start_weight_update())
        yield
        on_all(engines, lambda e: e.finish_weight_update(version))
