"""megatron-core's asynchronous checkpoint request, written by a thread of this process.

``dist_checkpointing.save(..., async_sharded_save=True)`` plans the save (collectives across the
agent's ranks), writes ``common.pt`` and returns an ``AsyncRequest``: ``async_fn(rank,
write_buckets, results_queue)`` writes this rank's ``.distcp`` shards, and the ``finalize_fns``
(collective again) gather every rank's write results, write torch's ``.metadata`` and megatron's
``metadata.json``. megatron's own runner (``AsyncCallsQueue`` / ``TemporalAsyncCaller``) forks the
training process per save and forks again per shard file; its results queue must then be a
``spawn``-started multiprocessing Manager (a fresh interpreter that re-imports ``__main__``), and the
forked writers outlive a kill -9 of the trainer, still writing into the checkpoint folder.

:func:`start_writing` runs the request's write instead in a :class:`BackgroundWrite` thread: it
copies this rank's tensors to host memory first (a device → host copy on GPU; a clone on CPU when
the training goes on during the write, since the tensors are the live parameters and optimizer
state), then writes each shard file through a :class:`HashingWriter` (one thread per file, as
megatron's writer processes) and puts the write results where the request's finalize functions
read them. The same code runs on CPU (gloo) and GPU (NCCL); docs/checkpoints.md.
"""

from __future__ import annotations

import inspect
import os
import threading
from functools import partial
from typing import Any

import torch

from hacrl_megatron.agents.checkpoint_io import BackgroundWrite, FileDigest, HashingWriter

# FileSystemWriterAsync's write of a request: (transform_list, use_msc) bound, (rank, write_buckets,
# results_queue) as arguments, one {bucket index: write results} into the queue; renamed in 0.19
WRITE_FUNCTIONS = ("write_preloaded_data_multiproc", "write_preloaded_data_multithread")


def _expected_request(request: Any) -> bool:
    fn = getattr(request, "async_fn", None)
    return (isinstance(fn, partial) and getattr(fn.func, "__name__", "") in WRITE_FUNCTIONS
            and len(request.async_fn_args) == 3)


def host_copy(write_buckets: list, copy: bool) -> list:
    """The buckets with every tensor in host memory: device tensors copied to the host (the copy the
    step waits for), host tensors cloned when ``copy`` (the training changes them during the write)."""
    out, moved = [], False
    for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
        tensors = []
        for item, tensor in tensor_data:
            if tensor.device.type != "cpu":
                tensor, moved = tensor.to("cpu", non_blocking=True), True
            elif copy:
                tensor = tensor.clone()
            tensors.append((item, tensor))
        out.append((file_name, storage_key, (bytes_data, tensors)))
    if moved:
        torch.cuda.synchronize()
    return out


def _write_bucket(bucket: tuple, transforms: list, abort: threading.Event) -> tuple[list, FileDigest]:
    """One ``.distcp`` file: its items in megatron's order through a hashing writer; (write results, digest)."""
    from torch.distributed.checkpoint.filesystem import _write_item

    file_name, storage_key, (bytes_data, tensor_data) = bucket
    extra: dict[str, Any] = {}
    if "serialization_format" in inspect.signature(_write_item).parameters:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        extra["serialization_format"] = SerializationFormat.TORCH_SAVE
    with HashingWriter(file_name, abort) as stream:
        results = [_write_item(*transforms, stream, data, item, storage_key, **extra)
                   for item, data in [*bytes_data, *tensor_data]]
    return results, stream.digest


def _write_all(buckets: list, transforms: list, results_queue: Any, folder: str,
               abort: threading.Event) -> dict[str, FileDigest]:
    """Every bucket in a daemon thread of its own (a pool's threads would hold up the interpreter's exit
    until the files are written); the results go to ``results_queue`` as megatron's writer processes
    put them (bucket index → write results, or the first error: the finalize functions then raise it
    on every rank together, so no rank waits in a collective for a failed one)."""
    done: list[Any] = [None] * len(buckets)
    errors: list[Exception] = []

    def write(i: int) -> None:
        try:
            done[i] = _write_bucket(buckets[i], transforms, abort)
        except Exception as err:  # noqa: BLE001 - reported through the queue, like megatron's writers
            errors.append(err)

    threads = [threading.Thread(target=write, args=(i,), name=f"hacrl-distcp-{i}", daemon=True)
               for i in range(len(buckets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        results_queue.put(errors[0])
        return {}
    results_queue.put({i: results for i, (results, _) in enumerate(done)})
    return {os.path.relpath(b[0], folder).replace(os.sep, "/"): digest for b, (_, digest) in zip(buckets, done)}


def start_writing(request: Any, folder: str, copy: bool, name: str) -> BackgroundWrite | None:
    """Copy this rank's part of ``request`` to host memory and start writing it in a thread; None when
    the rank has nothing to write. ``copy``: clone host tensors too (the training goes on meanwhile)."""
    if request.async_fn is None:
        return None
    if not _expected_request(request):
        import megatron.core

        raise RuntimeError(f"megatron-core {megatron.core.__version__}: its async save request is not the "
                           "FileSystemWriterAsync one agents/dcp_writer.py writes (written for 0.16 and 0.19)")
    _rank, write_buckets, results_queue = request.async_fn_args
    transforms = list(request.async_fn.args[0])
    buckets = host_copy(write_buckets, copy)
    return BackgroundWrite(partial(_write_all, buckets, transforms, results_queue, folder), name)
