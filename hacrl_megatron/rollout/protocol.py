"""The engine seam: what an engine client offers the pool and the weight transports, and what a transport is.

An **engine client** (:class:`EngineClient`) is one rollout engine as :class:`~hacrl_megatron.rollout.
engine_pool.EnginePool` drives it: generation with fixed per-sample seeds, scoring, health, restart,
memory hand-over, counters, shutdown. A **weight transport** (:class:`WeightTransport`, implementations in
``sync/``) moves the trainer's HF-named tensors into every client of an agent; each transport names the
weight-update operations it calls on a client (``engine_protocol``), and a client that offers them can
be reached by it:

=====================  ==========================================================================
transport (``sync/``)  operations it calls on each client
=====================  ==========================================================================
disk                   :class:`DiskWeightLoader`: ``update_weights_from_disk(folder, version)``
tensor                 :class:`TensorWeightLoader`: ``tp_size``, ``update_weights_from_tensor(...)``
distributed            :class:`BroadcastWeightLoader`: ``init/destroy_weights_update_group``,
                       ``update_weights_from_distributed(...)``, ``base_url``, ``tp_size``, ``detached()``
tensor, distributed    and, where the engine has one, :class:`WeightUpdateSession` around every push:
                       ``begin_weight_update()`` ... ``end_weight_update()``
vllm_nccl, vllm_ipc    :class:`WeightTransferReceiver`: vLLM's weight-transfer engine (``init_weight_transfer``,
                       ``start_weight_update``, ``update_weights``, ``finish_weight_update``, ...); what
                       ``distributed`` and ``tensor`` mean for a vLLM server
=====================  ==========================================================================

How a client carries an operation out (an HTTP route, a method call in this process) is the client's
business: transports never see routes. :class:`~hacrl_megatron.rollout.sglang_engine.SGLangEngine`
offers all three; :class:`~hacrl_megatron.rollout.hf_engine.HFEngine` (in this process) offers disk;
:class:`~hacrl_megatron.rollout.vllm_engine.VLLMEngine` offers disk and the weight-transfer receiver.
A client's address (``base_url``) is whatever it was built with: a transport never assumes the engine
runs on this host.

No heavy imports (torch for type hints only).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from hacrl_megatron.rollout.types import Completion, SamplingParams

if TYPE_CHECKING:
    import torch


class EngineError(RuntimeError):
    """An engine refused or failed a request; the message names the engine and carries its reply."""


class EngineUnreachable(EngineError):
    """No connection to the engine (refused, reset): it is down or still starting."""


class EngineNodeLost(EngineError):
    """The node an engine's server ran on left the cluster: the engine cannot be restarted where it
    was placed, so the pool retires it (rollout/engine_pool.py) instead of reloading it elsewhere."""


@runtime_checkable
class EngineClient(Protocol):
    """One rollout engine as the pool drives it (a server's client, or a model in this process)."""

    name: str  # label in metrics ("engine0", ...)

    def generate_seeded(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                        seeds: list[int] | None) -> list[list[Completion]]:
        """``params.n`` completions per prompt, sample j of prompt i drawn with ``seeds[i · n + j]``
        (None: greedy decoding). A sample depends only on its seed, not on the call it is part of."""
        ...

    def sequence_logprob(self, prompt_ids: list[int], response_ids: list[int]) -> float:
        """Σ log π(response | prompt) under the current weights (nats, temperature 1)."""
        ...

    def health(self) -> bool:
        """The engine answers now."""
        ...

    def alive(self) -> bool:
        """The engine answers and, if this process started it, its process runs."""
        ...

    def restart(self) -> None:
        """Start the engine again (back on its initial weights); raises :class:`EngineError` if it cannot."""
        ...

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the engine's GPU memory ("weights", "kv_cache"; None: both) while the trainer trains."""
        ...

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take back what :meth:`release_memory` freed."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters since creation; at least tokens, seconds, tokens_per_s, sequences, restarts."""
        ...

    def close(self) -> None:
        """Stop what this client started (a server process); idempotent."""
        ...


@runtime_checkable
class DiskWeightLoader(Protocol):
    """A client that loads weights from a folder of safetensors files (``sync/disk.py``)."""

    def update_weights_from_disk(self, folder: str, version: int) -> None:
        """Load every tensor of ``folder`` (HF names; a folder every engine process can read) as weight
        version ``version``. Raises :class:`EngineError` when the engine refuses."""
        ...


@runtime_checkable
class TensorWeightLoader(Protocol):
    """A client that takes tensors as IPC handles from a process on its GPUs (``sync/tensor.py``)."""

    tp_size: int  # the engine's receiving ranks: one serialized copy of each bucket per rank

    def update_weights_from_tensor(self, serialized: list[str], *, flush_cache: bool, version: int) -> None:
        """Load one bucket: ``serialized[k]`` is rank k's copy (``sync/cuda_ipc.dumps_named_tensors``).
        ``flush_cache`` on the last bucket of a push; returns after the engine copied the tensors."""
        ...


@runtime_checkable
class BroadcastWeightLoader(Protocol):
    """A client whose ranks join a process group with the trainer and receive broadcast buckets
    (``sync/distributed.py``)."""

    base_url: str  # where the engine is reached (the trainer's address towards it is derived from it)
    tp_size: int  # the engine's ranks in the group

    def health(self) -> bool:
        """The engine answers now (checked before a broadcast that would otherwise hang on it)."""
        ...

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> None:
        """The engine's ranks join group ``group_name`` (ranks ``rank_offset`` … ``rank_offset + tp_size − 1``
        of ``world_size``; rank 0, the trainer, hosts the store at ``master_address:master_port``).
        Blocks until the group is complete."""
        ...

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, flush_cache: bool, version: int) -> None:
        """Receive one bucket broadcast from group rank 0: the tensors' bytes concatenated in order
        without padding (``sync/weight_group.flatten_bucket``); dtypes as torch names ("bfloat16").
        Returns after the engine loaded them."""
        ...

    def destroy_weights_update_group(self, group_name: str) -> None:
        """The engine's ranks leave group ``group_name``."""
        ...

    def detached(self) -> BroadcastWeightLoader:
        """A copy of this client that pickles (no server process, no tokenizer), for the trainer's ranks."""
        ...


@runtime_checkable
class WeightUpdateSession(Protocol):
    """A client whose engine takes ``tensor`` and ``distributed`` pushes only inside a session (SGLang
    0.5.21 and later refuse them otherwise): the transports call :meth:`begin_weight_update` on every
    engine before the first bucket and :meth:`end_weight_update` after the last, also when a bucket
    failed (``sync/base.weight_update_session``). Clients whose engine has no session lack these."""

    name: str

    def begin_weight_update(self) -> None:
        """Open the engine's session (nothing for an engine release without one)."""
        ...

    def end_weight_update(self) -> None:
        """Close it: the engine finalises the loaded weights."""
        ...


@runtime_checkable
class WeightTransferReceiver(Protocol):
    """A client whose server runs vLLM's weight-transfer engine (``sync/vllm_nccl.py``: NCCL broadcast;
    ``sync/vllm_ipc.py``: CUDA IPC handles). One update is ``start_weight_update``, any number of
    ``update_weights`` chunks, then ``finish_weight_update``: the server expects every weight in between."""

    base_url: str  # where the engine is reached (the trainer's address towards it is derived from it)
    tp_size: int  # the engine's ranks (each receives every tensor)

    def health(self) -> bool:
        """The engine answers now (checked before a transfer that would otherwise hang on it)."""
        ...

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Open the server's weight-transfer engine with ``init_info`` (NCCL: blocks until the group is complete)."""
        ...

    def start_weight_update(self) -> None:
        """Begin one update."""
        ...

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive and load one chunk (names, dtype_names, shapes and the backend's handles)."""
        ...

    def finish_weight_update(self, version: int) -> None:
        """End the update as weight version ``version`` (the server's caches dropped)."""
        ...

    def shutdown_weight_transfer(self) -> None:
        """Close the weight-transfer engine (its process group); the server keeps serving."""
        ...

    def detached(self) -> WeightTransferReceiver:
        """A copy of this client that pickles (no server process, no tokenizer), for the trainer's ranks."""
        ...


@runtime_checkable
class WeightTransport(Protocol):
    """Moves HF-named tensors from the trainer into engine clients (implementations: ``sync/``)."""

    name: str
    engine_protocol: type  # what every client must offer to be reached (one of the loaders above)

    def push(self, engines: Sequence[Any], named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Load ``named_tensors`` into every engine as weight version ``version``; returns the
        number of tensors sent. Consumes the iterator once (it may be a collective export)."""
        ...

    def restore(self, engine: Any, version: int) -> bool:
        """After ``engine`` restarted (initial weights): load version ``version`` into it without
        the trainer. False when this transport cannot (the engine then waits for the next push)."""
        ...

    def close(self) -> None:
        """Release what the transport holds (process groups, temporary files); idempotent."""
        ...


@dataclass(frozen=True)
class StartedEngines:
    """What an engine module's ``start_engines`` returns (``rollout/launch.py``).

    Fields:
        clients: one client per engine of the agent, on the agent's initial weights.
        model_dir: a folder holding those weights and the model's config files (what a server
            loaded; the disk transport copies its config files into each version folder), or None
            when the engine read no folder (the in-process HF engine).
    """

    clients: list[EngineClient]
    model_dir: Path | None = None


def check_reachable(engines: Sequence[Any], transport: WeightTransport, owner: str) -> None:
    """Raise ValueError naming the first engine that lacks an operation ``transport`` calls."""
    need = transport.engine_protocol
    for engine in engines:
        if not isinstance(engine, need):
            missing = [m for m in _members(need) if not hasattr(engine, m)]
            raise ValueError(f"{owner}: engine {getattr(engine, 'name', '?')!r} ({type(engine).__name__}) cannot take "
                             f"weights by {transport.name}: it lacks {missing}")


def _members(protocol: type) -> list[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {k for k, v in vars(protocol).items() if callable(v) and not k.startswith("_")}
    return sorted(names)
