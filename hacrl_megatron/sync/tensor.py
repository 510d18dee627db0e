"""Tensor weight sync for engines colocated with the trainer: CUDA IPC handles, no copy on the wire.

Per bucket and server, ``/update_weights_from_tensor`` gets ``serialized_named_tensors``: one
``dumps_named_tensors([(name, tensor), ...])`` per server TP rank (``sync/cuda_ipc.py``: the GPU is
named by UUID, not by index, because the server sees a different ``CUDA_VISIBLE_DEVICES``); every
rank opens its own copy of the handles and copies its shard. Only the last bucket flushes the server's
prefix cache. The trainer's tensors must stay alive until the reply: the call is synchronous.

Colocated engines give their GPU memory back while the trainer trains (``/release_memory_occupation``)
and take it again before the sync (``/resume_memory_occupation``): see
:class:`~hacrl_megatron.rollout.engine_pool.EnginePool`. CPU tensors (a trainer without CUDA, or
tensors that crossed Ray's object store) travel as shared-memory handles, same node only.
"""

from __future__ import annotations

from collections.abc import Sequence

from hacrl_megatron.sync.base import Endpoint, NamedTensors, buckets, on_all, with_last
from hacrl_megatron.sync.cuda_ipc import dumps_named_tensors


class TensorTransport:
    """Args:
        bucket_bytes: tensors per request, in bytes (one request per bucket and engine).
    """

    name = "tensor"

    def __init__(self, bucket_bytes: int = 512 << 20) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"TensorTransport: bucket_bytes={bucket_bytes} must be >= 1")
        self.bucket_bytes = bucket_bytes

    def push(self, engines: Sequence[Endpoint], named_tensors: NamedTensors, version: int) -> int:
        count = 0
        for bucket, last in with_last(buckets(named_tensors, self.bucket_bytes)):

            def send(engine: Endpoint, bucket: list = bucket, last: bool = last) -> None:
                engine.post("/update_weights_from_tensor", {
                    # one pickle per receiving rank: each unpickling consumes its handles (CUDA IPC
                    # reference counts, shared-memory file descriptors)
                    "serialized_named_tensors": [dumps_named_tensors(bucket) for _ in range(engine.tp_size)],
                    "flush_cache": last,
                    "weight_version": str(version),
                })

            on_all(engines, send)
            count += len(bucket)
        if count == 0:
            raise ValueError("TensorTransport.push: no tensors given")
        return count

    def restore(self, engine: Endpoint, version: int) -> bool:
        """A restarted server cannot get IPC handles without the trainer: it waits for the next push."""
        return False

    def close(self) -> None:
        """Nothing held between pushes."""
