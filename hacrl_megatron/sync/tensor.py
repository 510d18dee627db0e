"""Tensor weight sync for engines colocated with the trainer: CUDA IPC handles, no copy on the wire.

Per bucket and engine, ``update_weights_from_tensor`` (:class:`~hacrl_megatron.rollout.protocol.
TensorWeightLoader`) gets one ``dumps_named_tensors([(name, tensor), ...])`` per engine TP rank
(``sync/cuda_ipc.py``: the GPU is named by UUID, not by index, because the server sees a different
``CUDA_VISIBLE_DEVICES``); every rank opens its own copy of the handles and copies its shard. Only the
last bucket flushes the engine's prefix cache. The trainer's tensors must stay alive until the call
returns: it is synchronous.

Colocated engines give their GPU memory back while the trainer trains (``release_memory``) and take
it again before the sync (``resume_memory``): see
:class:`~hacrl_megatron.rollout.engine_pool.EnginePool`. CPU tensors (a trainer without CUDA, or
tensors that crossed Ray's object store) travel as shared-memory handles, same node only.
"""

from __future__ import annotations

from collections.abc import Sequence

from hacrl_megatron.rollout.protocol import TensorWeightLoader
from hacrl_megatron.sync.base import (
    NamedTensors,
    buckets,
    engine_failure,
    on_all,
    weight_update_session,
    with_last,
)
from hacrl_megatron.sync.cuda_ipc import dumps_named_tensors


class TensorTransport:
    """Args:
        bucket_bytes: tensors per request, in bytes (one request per bucket and engine).
    """

    name = "tensor"
    engine_protocol = TensorWeightLoader

    def __init__(self, bucket_bytes: int = 512 << 20) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"TensorTransport: bucket_bytes={bucket_bytes} must be >= 1")
        self.bucket_bytes = bucket_bytes

    def push(self, engines: Sequence[TensorWeightLoader], named_tensors: NamedTensors, version: int) -> int:
        """Every bucket to every engine, inside each engine's weight-update session (closed also when a
        bucket fails; errors name the engine). Returns the number of tensors."""
        count = 0
        with weight_update_session(engines):
            for bucket, last in with_last(buckets(named_tensors, self.bucket_bytes)):

                def send(engine: TensorWeightLoader, bucket: list = bucket, last: bool = last) -> None:
                    # one pickle per receiving rank: each unpickling consumes its handles (CUDA IPC
                    # reference counts, shared-memory file descriptors)
                    try:
                        engine.update_weights_from_tensor([dumps_named_tensors(bucket) for _ in range(engine.tp_size)],
                                                          flush_cache=last, version=version)
                    except Exception as e:
                        raise engine_failure(engine, "update_weights_from_tensor failed", e) from e

                on_all(engines, send)
                count += len(bucket)
        if count == 0:
            raise ValueError("TensorTransport.push: no tensors given")
        return count

    def restore(self, engine: TensorWeightLoader, version: int) -> bool:
        """A restarted server cannot get IPC handles without the trainer: it waits for the next push."""
        return False

    def close(self) -> None:
        """Nothing held between pushes."""
