"""Trainer offload for colocated engines (``rollout.colocate_offload``, docs/colocation.md): an agent's
GPU state goes to host memory while its engines generate on the same GPUs, and comes back before
the agent computes again.

What goes, per level (:data:`OFFLOAD_LEVELS`):

- ``optimizer``: the optimizer's state (Adam's ``exp_avg``, ``exp_avg_sq``), the fp32 main weights a
  mixed-precision optimizer keeps, and the gradients (megatron DDP's contiguous gradient buffers,
  each parameter's ``main_grad`` and ``.grad``). The model's weights stay: the weight sync exports
  them, and a no-grad forward (the post-sync probe) still runs.
- ``all``: the model's weights and buffers too (with the distributed optimizer, megatron DDP's
  contiguous parameter buffer).

How: storage by storage, so that every view stays valid. Megatron DDP's parameters and their
``main_grad`` are views into one contiguous parameter and one gradient buffer per dtype, each
bucket's ``param_data``/``grad_data`` too, and the distributed optimizer's fp32 shards of fp32
parameters are views of the parameter buffer. Each distinct storage is copied whole into a host
buffer and then resized to 0 bytes (``untyped_storage().resize_(0)``): the tensors and views keep
their storage object, shape, stride and offset, and only the memory behind it is given back. Waking
resizes each storage to its byte size and copies the bytes back, so every tensor and view reads
exactly the bytes it had (bit-identical), wherever the allocator puts the new memory. A storage that
something staying resident shares (at ``optimizer``: an FP32 optimizer's main params are the model's
own weights) stays.

Host buffers are pinned when CUDA is available (the copies then run at full PCIe speed and
asynchronously) and kept between steps: pinning anew at every sleep would cost seconds per 10 GB.
The host therefore holds the offloaded bytes for the whole run (docs/colocation.md, "Host memory").
After a sleep the CUDA caching allocator's free blocks go back to the driver
(``torch.cuda.empty_cache``): otherwise the engines' processes could not use them.

A tensor whose storage is parked must never be read (on CPU that is a segmentation fault, on CUDA an
illegal address): :class:`Offloadable` checks every entry point of the agent that reads weights,
gradients or optimizer state, and raises :class:`AgentAsleep` naming the call instead.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

OFFLOAD_LEVELS = ("none", "optimizer", "all")  # rollout.colocate_offload
_DEPTH = {"none": 0, "optimizer": 1, "all": 2}

# entry points of an agent and the deepest sleep they tolerate: 0 = fully awake (they write
# gradients or read the optimizer state), 1 = the weights awake (no-grad forwards, exports, snapshots)
NEEDS_AWAKE = {
    "train": 0, "train_async": 0, "save": 0, "begin_save": 0, "load": 0,
    "sequence_logprobs": 1, "token_logprobs": 1, "sequence_logprobs_at": 1, "reference_token_logprobs": 1,
    "keep_version": 1, "keep_reference": 1, "export_hf_weights": 1,
}


class AgentAsleep(RuntimeError):
    """A call needs state that is parked in host memory (the colocation schedule's order was broken)."""


def _storage_id(tensor: torch.Tensor) -> int:
    """The identity of the storage behind ``tensor`` (shared by all its views)."""
    return tensor.untyped_storage()._cdata


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor  # uint8 [nbytes], pinned when CUDA is available


class StorageParking:
    """Parks storages in host memory and brings them back (see the module docstring).

    Args:
        name: the agent's name (messages).
        model_tensors: the model's weights and buffers (what the ``all`` level adds).
        training_tensors: optimizer state, main weights and gradients (the ``optimizer`` level).
    """

    def __init__(self, name: str, model_tensors: Callable[[], Iterable[torch.Tensor]],
                 training_tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        self.name = name
        self._model_tensors = model_tensors
        self._training_tensors = training_tensors
        self.level = "none"  # how deep the agent sleeps now
        self._parked: dict[int, _Parked] = {}
        self._host: dict[int, torch.Tensor] = {}  # host buffers kept between sleeps, by storage id
        self.stats: dict[str, float] = {}

    def _storages(self, tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
        out: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage.nbytes() > 0:
                out.setdefault(storage._cdata, storage)
        return out

    def sleep(self, level: str) -> None:
        """Park what ``level`` names (``none``: nothing); sleeping ``all`` after ``optimizer`` parks
        the rest. Frees the CUDA cache in any case, so that other processes (the engines) get the
        memory: the caching allocator would otherwise keep the blocks the last pass freed."""
        if level not in _DEPTH:
            raise ValueError(f"agent {self.name!r}: offload level {level!r}: must be one of {list(OFFLOAD_LEVELS)}")
        if _DEPTH[level] <= _DEPTH[self.level]:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return
        start = time.perf_counter()
        model = self._storages(self._model_tensors())
        chosen = self._storages(self._training_tensors())
        chosen = {k: s for k, s in chosen.items() if k not in model}  # shared with the weights: stays at optimizer
        if level == "all":
            chosen.update(model)
        # a CPU storage that cannot be resized is memory-mapped from a checkpoint (transformers' loader) or
        # borrowed from numpy: file-backed or foreign memory, nothing a GPU gets back from; it stays
        chosen = {k: s for k, s in chosen.items() if s.resizable() or s.device.type != "cpu"}
        # every copy first, then every release: a storage that cannot be parked leaves all in place
        copied = {k: self._copy_out(k, s) for k, s in chosen.items() if k not in self._parked}
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the device-to-host copies are asynchronous: done before the memory goes
        for parked in copied.values():
            parked.storage.resize_(0)
        self._parked.update(copied)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.level = level
        self.stats["offload_mib"] = sum(p.nbytes for p in self._parked.values()) / 2**20
        self.stats["offload_s"] = self.stats.get("offload_s", 0.0) + time.perf_counter() - start

    def _copy_out(self, key: int, storage: torch.UntypedStorage) -> _Parked:
        if not storage.resizable():
            raise RuntimeError(f"agent {self.name!r}: a tensor of {storage.nbytes()} bytes on {storage.device} has a "
                               "storage that cannot be resized (memory from outside torch's allocator): it cannot be "
                               "offloaded; use rollout.colocate_offload=none")
        nbytes = storage.nbytes()
        host = self._host.get(key)
        if host is None or host.numel() != nbytes:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self._host[key] = host
        host.copy_(_bytes_of(storage), non_blocking=True)
        return _Parked(storage, nbytes, host)

    def wake(self) -> None:
        """Bring every parked storage back, byte for byte, into the same storage objects."""
        if self.level == "none":
            return
        start = time.perf_counter()
        for parked in self._parked.values():
            parked.storage.resize_(parked.nbytes)
            _bytes_of(parked.storage).copy_(parked.host, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host-to-device copies land before anything reads them
        # keep the host buffers of this cycle's storages only: a storage that went (a reloaded
        # optimizer state) must not keep its host buffer, nor be kept alive by one
        self._host = {k: self._host[k] for k in self._parked}
        self._parked = {}
        self.level = "none"
        self.stats["wake_s"] = self.stats.get("wake_s", 0.0) + time.perf_counter() - start

    def check(self, call: str, deepest: int) -> None:
        """Raise :class:`AgentAsleep` when ``call`` tolerates no sleep as deep as the current one."""
        if _DEPTH[self.level] > deepest:
            needs = "fully awake" if deepest == 0 else "its weights awake"
            raise AgentAsleep(f"agent {self.name!r}: {call}() needs the agent {needs}, but it sleeps at level "
                              f"{self.level!r} (its state is in host memory): wake() it first")


# --------------------------------------------------------------------------------------------
# which tensors an agent holds


def torch_optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """A torch optimizer's parameters (for mixed precision: the fp32 main weights), their ``.grad``
    and every tensor of its per-parameter state."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield p
            if p.grad is not None:
                yield p.grad
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def megatron_training_tensors(ddp: Any, optimizer: Any) -> Iterator[torch.Tensor]:
    """megatron-core's optimizer (plain, distributed or chained) and DDP gradients: each inner torch
    optimizer's tensors, every contiguous gradient buffer, each parameter's ``main_grad`` and ``.grad``."""
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(part, "optimizer", None)
        if inner is not None:  # None: a stub optimizer of a rank without parameters of that kind
            yield from torch_optimizer_tensors(inner)
    for buffer in list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", [])):
        if buffer.grad_data is not None:
            yield buffer.grad_data
    for p in ddp.parameters():
        for grad in (getattr(p, "main_grad", None), p.grad):
            if grad is not None:
                yield grad


def model_tensors(module: Any, ddp: Any = None) -> Iterator[torch.Tensor]:
    """A model's weights and buffers (and megatron DDP's contiguous parameter buffers, when there are)."""
    yield from module.parameters()
    yield from torch.nn.Module.buffers(module)  # megatron's DDP names its list of grad buffers ``buffers``
    for buffer in list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", [])):
        if buffer.param_data is not None:
            yield buffer.param_data


# --------------------------------------------------------------------------------------------
# the agents' side


def _guarded(method: Callable[..., Any], deepest: int) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Offloadable, *args: Any, **kwargs: Any) -> Any:
        self._parking().check(method.__name__, deepest)
        return method(self, *args, **kwargs)

    call.awake_guard = True  # type: ignore[attr-defined]
    return call


class Offloadable:
    """``sleep(level)`` and ``wake()`` for an agent with ``model`` (a torch module, megatron's DDP for
    a Megatron agent) and ``optimizer`` (a torch optimizer, or megatron-core's), and the checks of
    :data:`NEEDS_AWAKE` wrapped around the subclass's entry points of those names."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, deepest in NEEDS_AWAKE.items():
            method = getattr(cls, name, None)  # its own or a mixin's (agents/checkpoint.py's saves)
            if method is not None and not getattr(method, "awake_guard", False):
                setattr(cls, name, _guarded(method, deepest))

    def _parking(self) -> StorageParking:
        parking = self.__dict__.get("_storage_parking")
        if parking is None:
            # megatron (chained first: a ChainedOptimizer of several asserts when asked for .optimizer)
            if hasattr(self.optimizer, "chained_optimizers") or hasattr(self.optimizer, "optimizer"):
                training = functools.partial(megatron_training_tensors, self.model, self.optimizer)
                weights = functools.partial(model_tensors, self.model, self.model)
            else:
                def training() -> Iterator[torch.Tensor]:
                    yield from torch_optimizer_tensors(self.optimizer)
                    yield from (p.grad for p in self.model.parameters() if p.grad is not None)

                weights = functools.partial(model_tensors, self.model)
            parking = self.__dict__["_storage_parking"] = StorageParking(self.name, weights, training)
        return parking

    def sleep(self, level: str) -> None:
        """Move this rank's state to host memory: ``optimizer`` (optimizer state, main weights,
        gradients) or ``all`` (the weights too); ``none`` moves nothing. Units: the stats
        ``offload_mib`` (MiB parked now), ``offload_s`` and ``wake_s`` (seconds, summed over the run)."""
        parking = self._parking()
        parking.sleep(level)
        self._stats.update(parking.stats)

    def wake(self) -> None:
        """Bring back what :meth:`sleep` moved, bit-identical, into the same tensors."""
        parking = self._parking()
        parking.wake()
        self._stats.update(parking.stats)

    @property
    def asleep(self) -> str:
        """The current sleep level (``none``: awake)."""
        return self._parking().level
