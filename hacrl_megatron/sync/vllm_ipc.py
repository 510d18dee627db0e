"""``rollout.weight_sync: tensor`` for vLLM servers colocated with the trainer: vLLM's CUDA IPC weight
transfer (``vllm/distributed/weight_transfer/ipc_engine.py`` in vllm 0.32; CUDA only).

The server starts with ``--weight-transfer-config {"backend": "ipc"}`` and
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (``rollout/vllm_server.py``): over HTTP the handles travel
pickled. Per push: ``init_weight_transfer({"packed": false})`` once, ``start_weight_update`` on every
engine, then per bucket an ``update_weights`` request with the bucket's names, dtype names, shapes and
``ipc_handles_pickled`` (base64 of a pickle of one ``{gpu_uuid: rebuild args}`` per tensor: torch's
``reduce_tensor`` arguments, keyed by the GPU's UUID because the server numbers its GPUs differently;
vLLM swaps in its own device index), then ``finish_weight_update(version)``. vLLM's layer-wise reload
may keep a view of a received tensor until the layer is complete, so the trainer keeps every tensor of
a push alive until ``finish_weight_update`` returns (the peak is one exported copy of the weights,
what vLLM's own trainer engine holds too).

Each engine rank opens the handles on the GPU the tensor lives on, so every rank of the engine must sit
on that GPU: ``rollout.vllm.tp`` 1 with this transport (``config/validation.py``).
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hacrl_megatron.rollout.protocol import WeightTransferReceiver
from hacrl_megatron.sync.base import NamedTensors, buckets, on_all
from hacrl_megatron.sync.cuda_ipc import device_uuid


def ipc_handle(tensor: torch.Tensor, *, reduce: Callable | None = None,
               uuid_of: Callable[[int], str] = device_uuid) -> dict[str, tuple]:
    """``{uuid of the tensor's GPU: torch's rebuild arguments}`` (what vLLM's IPC receiver looks up).
    ``reduce`` (torch's ``reduce_tensor``) and ``uuid_of`` are parameters so that CPU tests can check it."""
    if reduce is None:
        from torch.multiprocessing.reductions import reduce_tensor as reduce
    _, args = reduce(tensor)
    return {uuid_of(tensor.device.index): args}


def bucket_update_info(bucket: Sequence[tuple[str, torch.Tensor]], *,
                       handle: Callable[[torch.Tensor], dict[str, tuple]] = ipc_handle) -> dict[str, Any]:
    """vLLM's ``IPCWeightTransferUpdateInfo`` of one bucket, as it travels over HTTP."""
    handles = [handle(t) for _, t in bucket]
    return {"names": [n for n, _ in bucket], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii")}


class VLLMIPCTransport:
    """Args:
        bucket_bytes: tensors per request, in bytes (one request per bucket and engine).
    """

    name = "tensor"
    engine_protocol = WeightTransferReceiver

    def __init__(self, bucket_bytes: int = 512 << 20) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"VLLMIPCTransport: bucket_bytes={bucket_bytes} must be >= 1")
        self.bucket_bytes = bucket_bytes
        self._opened: set[str] = set()  # base URLs whose transfer engine was initialised

    def _open(self, engines: Sequence[WeightTransferReceiver]) -> None:
        for engine in engines:
            if engine.tp_size != 1:
                raise ValueError(f"VLLMIPCTransport: engine {engine.base_url} has tp_size={engine.tp_size}; CUDA IPC "
                                 "reaches one GPU (rollout.vllm.tp must be 1 with rollout.weight_sync=tensor)")
        todo = [e for e in engines if e.base_url not in self._opened]
        if todo:
            on_all(todo, lambda e: e.init_weight_transfer({"packed": False}))
            self._opened.update(e.base_url for e in todo)

    def push(self, engines: Sequence[WeightTransferReceiver], named_tensors: NamedTensors, version: int) -> int:
        if not engines:
            raise ValueError("VLLMIPCTransport.push: no engines")
        self._open(engines)
        device = torch.device("cuda", torch.cuda.current_device())
        alive: list[torch.Tensor] = []  # every sent tensor until the engines finished the update
        on_all(engines, lambda e: e.start_weight_update())
        for bucket in buckets(named_tensors, self.bucket_bytes):
            bucket = [(n, t.detach().to(device).contiguous()) for n, t in bucket]
            alive.extend(t for _, t in bucket)
            torch.cuda.current_stream(device).synchronize()  # the copies above are done before a server reads them
            info = bucket_update_info(bucket)
            on_all(engines, lambda e, info=info: e.update_weights(info))
        if not alive:
            raise ValueError("VLLMIPCTransport.push: no tensors given")
        on_all(engines, lambda e: e.finish_weight_update(version))
        return len(alive)

    def restore(self, engine: WeightTransferReceiver, version: int) -> bool:
        """A restarted server cannot get IPC handles without the trainer: it waits for the next push
        (and opens its transfer engine again)."""
        self._opened.discard(engine.base_url)
        return False

    def close(self) -> None:
        """Nothing held between pushes (the servers' transfer engines close with the servers)."""
        self._opened.clear()
