"""What every weight transport shares: bucketing and concurrent calls to every engine.

A transport moves one agent's HF-named full tensors (``agent.export_hf_weights()``: gathered
across TP, collected from every PP stage) into all engine clients of that agent, through the
weight-update operations the clients offer (``rollout/protocol.py``; a transport never sees how a
client carries them out):

- :class:`~hacrl_megatron.sync.disk.DiskTransport`: safetensors shards in a folder every engine
  can read, then ``update_weights_from_disk``;
- :class:`~hacrl_megatron.sync.tensor.TensorTransport`: CUDA IPC handles
  (``update_weights_from_tensor``), for engines colocated on the trainer's GPUs;
- :class:`~hacrl_megatron.sync.distributed.DistributedTransport`: broadcast over one process
  group of trainer rank 0 + every engine rank (``update_weights_from_distributed``).

The in-process HF engine needs none of them by default: it copies the tensors itself
(``HFEngine.sync_from``). ``sync/push.py`` builds the transport the configuration names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["NamedTensors", "buckets", "on_all", "tensor_bytes", "with_last"]

T = TypeVar("T")
E = TypeVar("E")
NamedTensors = Iterable[tuple[str, torch.Tensor]]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def buckets(named_tensors: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of one dtype and at most ``bucket_bytes`` bytes each.

    A tensor larger than ``bucket_bytes`` travels alone. One dtype per bucket keeps every tensor's
    byte offset in a flattened bucket a multiple of its element size (a receiver views the bytes as
    the dtype in place). Consumes the stream lazily: at most one bucket is held.
    """
    if bucket_bytes < 1:
        raise ValueError(f"buckets: bucket_bytes={bucket_bytes} must be >= 1")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        n = tensor_bytes(tensor)
        if bucket and (size + n > bucket_bytes or tensor.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """``(item, is_last)`` with one item of look-ahead (the last bucket flushes the server's cache)."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def on_all(engines: Sequence[E], call: Callable[[E], T]) -> list[T]:
    """``call(engine)`` for every engine concurrently (one thread each); re-raises the first error."""
    if len(engines) == 1:
        return [call(engines[0])]
    with ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix="weight-sync") as pool:
        futures = [pool.submit(call, e) for e in engines]
        return [f.result() for f in futures]
