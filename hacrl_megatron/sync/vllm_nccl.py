"""``rollout.weight_sync: distributed`` for vLLM servers: vLLM's own NCCL weight transfer (CUDA only).

vLLM's workers do not join a torch process group: their side of the transfer (``vllm/distributed/
weight_transfer/nccl_engine.py`` in vllm 0.32) is a PyNccl communicator built either from vLLM's own
TCP store or, for trainers without vLLM installed, from a pre-shared ``ncclUniqueId``. The trainer runs
without vLLM (vLLM lives in its own venv), so it takes the second way:

1. rank 0 (this process, or a Ray agent's trainer rank 0) mints the id with ``torch.cuda.nccl.unique_id()``
   and sends every engine ``init_weight_transfer`` with ``{"nccl_unique_id_b64", "rank_offset",
   "world_size", "packed": true, "packed_buffer_size_bytes", "packed_num_buffers"}`` (engine k's ranks
   start at ``1 + Σ_{j<k} tp_j``, as for SGLang) while it joins as rank 0 (``torch.cuda.nccl.init_rank``);
   there is no store and no barrier, so both sides enter at once, and every vLLM rank's communicator
   opens with a one-element float32 ``all_reduce`` that rank 0 must answer before anything else;
2. per push: ``start_weight_update`` on every engine, then per chunk an ``update_weights`` request with
   the chunk's names, dtype names and shapes (sent concurrently with rank 0's broadcast of the chunk's
   bytes: both block inside the same NCCL call), then ``finish_weight_update(version)``.

Chunks are cut by :func:`packed_chunks` exactly as vLLM's packed consumer cuts a stream
(``packed_nccl_broadcast_consumer``: tensors are added until their bytes exceed the buffer size, the
tensor that crosses it included), so each ``update_weights`` request is one broadcast on both sides.
A restarted server leaves the group: the next push shuts the transfer down everywhere and opens a new one.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from hacrl_megatron.rollout.protocol import EngineUnreachable, WeightTransferReceiver
from hacrl_megatron.sync.base import NamedTensors, on_all, tensor_bytes
from hacrl_megatron.sync.nccl_version import Version, check_nccl_versions, engine_versions

NUM_BUFFERS = 2  # vLLM's packed_num_buffers: its receive streams (a wire parameter both sides must agree on)


def packed_chunks(named_tensors: NamedTensors, buffer_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive chunks of ``named_tensors`` as vLLM's packed NCCL consumer reads them: a chunk ends
    with the first tensor that brings its bytes above ``buffer_bytes`` (or at the end of the stream).
    Dtypes may mix (the bytes are concatenated; the receiver copies each tensor out)."""
    if buffer_bytes < 1:
        raise ValueError(f"packed_chunks: buffer_bytes={buffer_bytes} must be >= 1")
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        chunk.append((name, tensor))
        size += tensor_bytes(tensor)
        if size > buffer_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def chunk_update_info(chunk: Sequence[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """vLLM's ``NCCLWeightTransferUpdateInfo`` of one chunk: names, dtype names ("bfloat16"), shapes."""
    return {"names": [n for n, _ in chunk], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in chunk],
            "shapes": [list(t.shape) for _, t in chunk]}


def flat_bytes(chunk: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The chunk's tensors as one uint8 tensor on ``device``, in order, no padding (vLLM's pack_tensors)."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8).to(device) for _, t in chunk]
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


class _Rank0:
    """This process as rank 0 of the NCCL group (``torch.cuda.nccl``'s communicator, current device)."""

    def __init__(self, unique_id: bytes, world_size: int) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.comm = torch.cuda.nccl.init_rank(world_size, unique_id, 0)
        warmup = torch.zeros(1, device=self.device)  # answers every vLLM rank's warm-up all_reduce
        torch.cuda.nccl.all_reduce([warmup], comms=[self.comm])
        torch.cuda.current_stream(self.device).synchronize()

    def broadcast(self, flat: torch.Tensor) -> None:
        torch.cuda.nccl.broadcast([flat], root=0, comms=[self.comm])
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self.comm = None  # the communicator is destroyed with its last reference


class VLLMNCCLTransport:
    """Args:
        bucket_bytes: bytes per chunk (vLLM's ``packed_buffer_size_bytes``; ``rollout.weight_sync_bucket_mb``).
        timeout_s: per-request timeout while a chunk is in flight.
        ranks: an agent whose own ranks push (a Ray agent): its rank 0 holds a transport of its own
            (:class:`VLLMRankSenderFactory`) and the stream given to :meth:`push` is not read.
        engine_nccl: the engines' NCCL versions ({base_url: version}) read where their server handles
            are (the controller, for a Ray agent's rank 0); the group opens only when they equal this
            process's (``sync/nccl_version.py``).
        updates: bracket each push with ``start_weight_update`` … ``finish_weight_update`` (False: the
            caller does, around several senders' pushes, ``sync/vllm_stages.py``).
    """

    name = "distributed"
    engine_protocol = WeightTransferReceiver

    def __init__(self, bucket_bytes: int = 512 << 20, *, timeout_s: float = 600.0, ranks: Any | None = None,
                 engine_nccl: dict[str, Version | None] | None = None, updates: bool = True) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"VLLMNCCLTransport: bucket_bytes={bucket_bytes} must be >= 1")
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.ranks = ranks
        self.engine_nccl = dict(engine_nccl or {})
        self._rank0: _Rank0 | None = None
        self._members: list[WeightTransferReceiver] = []
        self._stale = False
        self._senders_open = False
        self.updates = updates
        self.chunks_sent = 0
        self.bytes_sent = 0

    # ---- the group -------------------------------------------------------------------------
    def init_info(self, unique_id: bytes, rank_offset: int, world_size: int) -> dict[str, Any]:
        """What engine k is sent to join the group (vLLM's ``NCCLWeightTransferInitInfo``)."""
        return {"nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"), "rank_offset": rank_offset,
                "world_size": world_size, "packed": True, "packed_buffer_size_bytes": self.bucket_bytes,
                "packed_num_buffers": NUM_BUFFERS}

    def _ensure_group(self, engines: Sequence[WeightTransferReceiver]) -> None:
        key = [(e.base_url, e.tp_size) for e in engines]
        if self._rank0 is not None and not self._stale and key == [(e.base_url, e.tp_size) for e in self._members]:
            return
        self._close_group()
        check_nccl_versions("vllm", engines, self.engine_nccl)  # NCCL refuses ranks of different versions
        unique_id, world = torch.cuda.nccl.unique_id(), 1 + sum(e.tp_size for e in engines)
        offsets = [1 + sum(e.tp_size for e in engines[:k]) for k in range(len(engines))]
        with ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix="vllm-nccl-init") as pool:
            # every engine blocks in ncclCommInitRank until rank 0 below joins: no barrier on this path
            futures = [pool.submit(e.init_weight_transfer, self.init_info(unique_id, off, world))
                       for e, off in zip(engines, offsets)]
            self._rank0 = _Rank0(unique_id, world)
            for f in futures:
                f.result(timeout=self.timeout_s)
        self._members, self._stale = list(engines), False

    def _close_group(self) -> None:
        for engine in self._members:
            try:
                engine.shutdown_weight_transfer()
            except Exception:  # noqa: BLE001  (a dead or restarted server has no transfer engine left)
                pass
        if self._rank0 is not None:
            self._rank0.close()
        self._rank0, self._members = None, []

    # ---- one push --------------------------------------------------------------------------
    def _send_chunk(self, pool: ThreadPoolExecutor, engines: Sequence[WeightTransferReceiver],
                    chunk: list[tuple[str, torch.Tensor]]) -> None:
        assert self._rank0 is not None
        flat, info = flat_bytes(chunk, self._rank0.device), chunk_update_info(chunk)
        futures = [pool.submit(e.update_weights, info) for e in engines]
        for f in futures:
            if f.done() and f.exception() is not None:  # refused before any NCCL call: do not hang in broadcast
                raise f.exception()
        self._rank0.broadcast(flat)
        for f in futures:
            f.result(timeout=self.timeout_s)
        self.chunks_sent += 1
        self.bytes_sent += flat.numel()

    def push(self, engines: Sequence[WeightTransferReceiver], named_tensors: NamedTensors, version: int) -> int:
        """Broadcast ``named_tensors`` into every engine as weight version ``version`` (module docstring);
        with ``ranks``, the agent's own rank 0 does it from its export."""
        if not engines:
            raise ValueError("VLLMNCCLTransport.push: no engines")
        if self.ranks is not None:
            return self._push_from_ranks(engines, version)
        down = [e.base_url for e, up in zip(engines, on_all(engines, lambda e: bool(e.health()))) if not up]
        if down:
            raise EngineUnreachable(f"vLLM weight transfer: {', '.join(down)} fail(s) the health check")
        count = 0
        try:
            self._ensure_group(engines)
            if self.updates:
                on_all(engines, lambda e: e.start_weight_update())
            with ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix="vllm-nccl") as pool:
                for chunk in packed_chunks(named_tensors, self.bucket_bytes):
                    self._send_chunk(pool, engines, chunk)
                    count += len(chunk)
            if count == 0:
                raise ValueError("VLLMNCCLTransport.push: no tensors given")
            if self.updates:
                on_all(engines, lambda e: e.finish_weight_update(version))
        except BaseException:
            self._stale = True  # a half-done update or a broken group: rebuilt at the next push
            raise
        return count

    def _push_from_ranks(self, engines: Sequence[WeightTransferReceiver], version: int) -> int:
        if not self._senders_open or self._stale:
            self._close_ranks()
            self.ranks.open_weight_sender(VLLMRankSenderFactory(self.bucket_bytes, self.timeout_s,
                                                                engine_versions(engines)))
            self._senders_open, self._stale = True, False
        try:
            return self.ranks.push_weights([e.detached() for e in engines], version)
        except BaseException:
            self._stale = True
            raise

    def _close_ranks(self) -> None:
        if self._senders_open:
            self._senders_open = False
            try:
                self.ranks.close_weight_sender()
            except Exception:  # noqa: BLE001  (an agent already shut down took its group with it)
                pass

    def restore(self, engine: WeightTransferReceiver, version: int) -> bool:
        """A restarted server left the group: the next push rebuilds it; until then it waits."""
        self._stale = True
        return False

    def close(self) -> None:
        """Shut the transfer down on every reachable member and here, and the senders on an agent's ranks."""
        self._close_ranks()
        self._close_group()


@dataclass(frozen=True)
class VLLMRankSenderFactory:
    """Builds each rank's sender on a Ray agent's ranks (``sync/distributed.RankSender``'s contract:
    rank 0 holds a :class:`VLLMNCCLTransport`, the others only run their part of the export)."""

    bucket_bytes: int
    timeout_s: float
    engine_nccl: dict[str, Version | None] | None = None  # {base_url: NCCL version} read by the controller

    def __call__(self, rank: int) -> Any:
        from hacrl_megatron.sync.distributed import RankSender

        return RankSender(None if rank else VLLMNCCLTransport(self.bucket_bytes, timeout_s=self.timeout_s,
                                                              engine_nccl=self.engine_nccl))

