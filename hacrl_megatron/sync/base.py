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
  group of trainer rank 0 + every engine rank (``update_weights_from_distributed``);
- :class:`~hacrl_megatron.sync.stages.StageTransport`: the same from every pipeline stage of a Ray
  agent, each stage's first rank over a group of its own, sending only its stage's tensors.

The in-process HF engine needs none of them by default: it copies the tensors itself
(``HFEngine.sync_from``). ``sync/push.py`` builds the transport the configuration names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from hacrl_megatron.rollout.protocol import EngineError, WeightUpdateSession

__all__ = ["DaemonCall", "NamedTensors", "buckets", "engine_failure", "on_all", "tensor_bytes",
           "weight_update_session", "with_last"]

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


def on_all_settled(engines: Sequence[E], call: Callable[[E], Any]) -> list[BaseException | None]:
    """``call(engine)`` for every engine concurrently; each one's exception (None: it succeeded)."""
    def settled(engine: E) -> BaseException | None:
        try:
            call(engine)
        except Exception as e:  # noqa: BLE001  (returned to the caller, which names the engine)
            return e
        return None

    return on_all(engines, settled)


def engine_failure(engine: Any, what: str, error: BaseException) -> BaseException:
    """``error`` re-made with the engine's name and ``what`` failed in front (same class, so that an
    :class:`~hacrl_megatron.rollout.protocol.EngineUnreachable` still reads as a dead engine)."""
    message = f"engine {getattr(engine, 'name', '?')} ({getattr(engine, 'base_url', 'in process')}): {what}: {error}"
    if isinstance(error, EngineError):
        try:
            return type(error)(message)
        except TypeError:  # an error class with another signature keeps its own class name in the text
            pass
    return EngineError(message)


@contextmanager
def weight_update_session(engines: Sequence[Any]) -> Iterator[None]:
    """Run the body (every bucket of one push) inside each engine's weight-update session.

    ``begin_weight_update`` goes to every engine that has a session
    (:class:`~hacrl_megatron.rollout.protocol.WeightUpdateSession`) before the body; if one refuses, the
    sessions already opened are closed and nothing is pushed. ``end_weight_update`` goes to every engine
    whose session opened, also when the body failed (its error is then the one raised; a failing end
    is reported on it). Errors name the engine.
    """
    sessions = [e for e in engines if isinstance(e, WeightUpdateSession)]
    began = on_all_settled(sessions, lambda e: e.begin_weight_update())
    opened = [e for e, err in zip(sessions, began) if err is None]
    refused = [(e, err) for e, err in zip(sessions, began) if err is not None]
    if refused:
        on_all_settled(opened, lambda e: e.end_weight_update())
        engine, err = refused[0]
        raise engine_failure(engine, "begin_weight_update refused, nothing pushed", err) from err
    try:
        yield
    except BaseException as failure:
        for engine, err in zip(opened, on_all_settled(opened, lambda e: e.end_weight_update())):
            if err is not None:
                failure.add_note(f"engine {engine.name}: end_weight_update after the failure failed too: {err}")
        raise
    ended = on_all_settled(opened, lambda e: e.end_weight_update())
    for engine, err in zip(opened, ended):
        if err is not None:
            raise engine_failure(engine, "end_weight_update failed after the push", err) from err


class DaemonCall:
    """``call()`` for one engine in a daemon thread (``done`` set when it returned or raised, ``error``):
    a request that hangs (a server stuck in a broadcast) must not keep the trainer waiting or its
    process from exiting. ``what`` names it in the thread's name."""

    def __init__(self, engine: Any, call: Callable[[], Any], what: str) -> None:
        self.engine, self.what, self.error = engine, what, None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(call,), daemon=True, name=f"weight-{what}-{engine.name}").start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001  (read by the transport, which names the engine)
            self.error = e
        finally:
            self.done.set()

    @property
    def failed(self) -> bool:
        return self.done.is_set() and self.error is not None

    def outcome(self) -> str:
        if not self.done.is_set():
            return "still waiting (its server leaves the group when the group times out)"
        return f"failed: {self.error}" if self.error is not None else "done"


class RankSenders:
    """The senders a transport keeps open on an agent's Ray ranks (``self.ranks``: ``open_weight_sender``,
    ``push_weights``, ``close_weight_sender``) between pushes. A restarted server or a failed push marks
    them stale (``_stale``); the next push closes them and opens fresh ones (new weight groups)."""

    ranks: Any
    _senders_open: bool = False
    _stale: bool = False

    def _push_through_ranks(self, engines: Sequence[Any], version: int, factory: Callable[[], Any]) -> Any:
        """Open the ranks' senders with ``factory()`` when none are open or they are stale, then push."""
        if not self._senders_open or self._stale:
            self._close_ranks()
            self.ranks.open_weight_sender(factory())
            self._senders_open, self._stale = True, False
        try:
            return self.ranks.push_weights([e.detached() for e in engines], version)
        except BaseException:
            self._stale = True
            raise

    def _close_ranks(self) -> None:
        if not self._senders_open:
            return
        self._senders_open = False
        try:
            self.ranks.close_weight_sender()
        except Exception:  # noqa: BLE001  (an agent already shut down took its groups with it)
            pass
