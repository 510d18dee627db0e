"""Reshardable agent checkpoints with megatron-core ``dist_checkpointing``.

A checkpoint holds the model, the optimizer (Adam moments, per parameter shard), the LR scheduler
and the number of updates, plus ``hacrl_meta``: the model's :class:`ArchSpec` as a dict, checked on
load so that a checkpoint of another architecture or size fails with a message naming the fields
that differ (instead of a shape error deep inside megatron). Tensors are saved as global
ShardedTensors, so a checkpoint written at TP = 2 / PP = 2 loads at TP = 1 / PP = 1 and back.

Atomicity: :func:`save_checkpoint` writes into the directory it is given. The trainer writes the
joint checkpoint of all agents into a temporary directory and renames the whole directory when
every agent has finished, so a crash never leaves a half-written checkpoint behind.

Saves run in two halves (:func:`begin_save`, :meth:`PendingSave.finish`): the first plans the save
with megatron-core's asynchronous ``dist_checkpointing`` request and copies this rank's tensors to
host memory, a thread then writes them (agents/dcp_writer.py) while the training may go on, and
``finish`` completes the request on every rank and returns each file's size and SHA-256, hashed as
it was written. :func:`save_checkpoint` is both at once. See :func:`_in_process_results_queue` for
why no multiprocessing Manager is started (scripts need no ``if __name__ == "__main__"`` guard).

Damage: :func:`check_files` names a missing or empty ``common.pt``, ``.metadata`` or
``metadata.json`` before megatron-core reads anything, and read errors of a truncated shard come
back as :class:`DamagedCheckpointError` naming the checkpoint folder. Given the manifest's digests,
:func:`load_checkpoint` hashes every file as it is loaded and names the one that differs.

Security: torch's distributed-checkpoint ``.metadata`` is a Python pickle, read with
``pickle.load``, so loading a checkpoint runs whatever code it was made to hold. Load Megatron
checkpoints (``init_checkpoint``, ``hacrl convert --from-megatron``) only from folders you trust
(docs/security.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pickle
from collections.abc import Iterator
from typing import Any

from hacrl_megatron.agents.checkpoint_io import (
    BackgroundWrite,
    DamagedCheckpointError,
    FileDigest,
    check_digest,
    hash_files,
    verified_dcp_reads,
)
from hacrl_megatron.agents.dcp_writer import start_writing
from hacrl_megatron.models.convert import CheckpointMismatchError
from hacrl_megatron.models.cpu_compat import enable_cpu_compat
from hacrl_megatron.models.provider import ArchSpec

__all__ = ["DamagedCheckpointError", "MegatronCheckpointing", "PendingSave", "begin_save", "check_files",
           "load_checkpoint", "save_checkpoint"]

_META = "hacrl_meta"
_HF_CONFIG = "hf_config"
_OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
_REQUIRED_FILES = ("metadata.json",)  # every torch_dist checkpoint has it



@functools.cache
def _save_takes_async_strategy() -> bool:
    """Whether this megatron-core's ``dist_checkpointing.save`` has the ``async_strategy`` argument (0.19)."""
    import inspect

    try:
        from megatron.core import dist_checkpointing
    except ImportError:
        return False
    return "async_strategy" in inspect.signature(dist_checkpointing.save).parameters


def _required_files() -> tuple[str, ...]:
    """The files every checkpoint that the installed megatron-core writes must hold. Up to 0.18 the
    common state and torch's distributed-checkpoint metadata are files of their own (``common.pt``,
    ``.metadata``); megatron-core 0.19 keeps the common state inside the ``.distcp`` shards and writes
    neither (measured with 0.16.1 and 0.19.2)."""
    import megatron.core
    from packaging.version import Version

    if Version(megatron.core.__version__) >= Version("0.19"):
        return _REQUIRED_FILES
    return _REQUIRED_FILES + ("common.pt", ".metadata")
_COMPARED = ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
             "vocab_size", "tie_embeddings", "qkv_bias", "qk_norm", "num_experts", "moe_topk", "moe_ffn_hidden_size",
             "shared_expert_ffn_hidden_size", "norm_topk_prob")


def check_files(path: str) -> None:
    """Raise :class:`DamagedCheckpointError` naming the first missing or empty file of a Megatron checkpoint.

    megatron-core reports these cases from deep inside its reader (``metadata is None``, an
    ``AttributeError`` on its own error path), so they are checked here first.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    for name in _required_files():
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            raise DamagedCheckpointError(f"{path}: {name} is missing (not a complete Megatron checkpoint)")
        if os.path.getsize(f) == 0:
            raise DamagedCheckpointError(f"{path}: {name} is empty (damaged checkpoint)")
    if not any(name.endswith(".distcp") for name in os.listdir(path)):
        raise DamagedCheckpointError(f"{path}: holds no .distcp tensor shards (not a complete Megatron checkpoint)")


def _sharded_state(model: Any, optimizer: Any, with_optimizer: bool, is_loading: bool) -> dict[str, Any]:
    model_sd = model.sharded_state_dict()
    state: dict[str, Any] = {"model": model_sd}
    if with_optimizer:
        # 'fully_reshardable': the distributed optimizer's state is saved in model-parameter space,
        # so it reloads at another TP/PP/DP layout (mcore's default format is rejected by its own
        # dist_checkpointing on 0.16: "ShardedTensor.flattened_range is not supported")
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPT_METADATA)
    return state


def save_checkpoint(path: str, model: Any, optimizer: Any, scheduler: Any, spec: ArchSpec, updates: int,
                    hf_config: Any = None) -> dict[str, FileDigest]:
    """Write model (+ optimizer + scheduler when given) + update count under ``path`` (created if missing);
    returns every file's digest (:meth:`PendingSave.finish`).

    ``hf_config`` (a transformers config) is stored too, so the checkpoint can be exported to an HF
    directory without the original model (``hacrl convert --from-megatron``). Collective: every rank
    of the agent calls it.
    """
    return begin_save(path, model, optimizer, scheduler, spec, updates, hf_config).finish()


def begin_save(path: str, model: Any, optimizer: Any, scheduler: Any, spec: ArchSpec, updates: int,
               hf_config: Any = None, background: bool = False) -> PendingSave:
    """Start :func:`save_checkpoint`: returns once this rank's state is copied for the writer thread.

    ``background``: the caller goes on training before :meth:`PendingSave.finish`, so host tensors are
    cloned too (on GPU every tensor is copied to host memory anyway). Collective, like the save.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    # a never-stepped optimizer has no state: save none, and restore a fresh optimizer on load
    stepped = optimizer is not None and _has_state(optimizer)
    state = _sharded_state(model, optimizer, stepped, is_loading=False)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    state["updates"] = int(updates)
    state[_META] = {**dataclasses.asdict(spec), "distributed_optimizer": optimizer is not None and _is_distributed(optimizer),
                    "has_optimizer": optimizer is not None, "optimizer_stepped": stepped}
    if hf_config is not None:
        state[_HF_CONFIG] = hf_config.to_dict()
    _in_process_results_queue()
    # megatron-core >= 0.19 defaults the asynchronous strategy to "nvrx" (NVIDIA's resiliency extension,
    # a package of its own); "mcore" is the request our writer runs (agents/dcp_writer.py)
    strategy = {"async_strategy": "mcore"} if _save_takes_async_strategy() else {}
    request = dist_checkpointing.save(state, path, async_sharded_save=True, **strategy)  # plans, writes common.pt
    return PendingSave(path, request, start_writing(request, path, copy=background, name=os.path.basename(path)))


class PendingSave:
    """A Megatron save whose shards may still be being written (:func:`begin_save`)."""

    def __init__(self, path: str, request: Any, write: BackgroundWrite | None) -> None:
        self.path, self._request, self._write = path, request, write

    def finish(self) -> dict[str, FileDigest]:
        """Wait for this rank's shards, complete the save on every rank (collective: torch's
        ``.metadata``, megatron's ``metadata.json``) and return every file of the checkpoint with its
        size and SHA-256 (relative paths), on every rank. A failed write raises on every rank."""
        import torch.distributed as dist

        digests = self._write.result() if self._write is not None else {}
        for finalize in self._request.finalize_fns:
            finalize()
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, digests)
        merged = {rel: d for part in parts for rel, d in part.items()}
        if dist.get_rank() == 0:  # every rank's shards and the metadata are written once finalized
            check_files(self.path)
            merged.update(hash_files(self.path, skip=set(merged)))  # common.pt, .metadata, metadata.json
        shared = [merged]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]

    def abandon(self) -> None:
        """Stop the writer thread (the checkpoint is being discarded); no collective."""
        if self._write is not None:
            self._write.abandon()


def _in_process_results_queue() -> None:
    """Give the next save's writer a fresh in-process queue for its write results.

    By default megatron creates a ``spawn``-context multiprocessing Manager for that queue, which starts
    a fresh interpreter (seconds on a loaded CPU box) and re-imports the caller's ``__main__``, so
    scripts without an ``if __name__ == "__main__"`` guard would recurse. Our writer is a thread of
    this process (agents/dcp_writer.py), so a ``queue.Queue`` is equivalent; a new one per save, since
    the writer captures it and two agents' saves may be in flight at once.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()


def read_meta(path: str) -> tuple[ArchSpec, Any]:
    """(ArchSpec, HF config or None) stored in a checkpoint, without loading tensors."""
    common = _common(path)
    meta = {k: v for k, v in common[_META].items() if k in {f.name for f in dataclasses.fields(ArchSpec)}}
    hf_dict = common.get(_HF_CONFIG)
    hf_config = None
    if hf_dict is not None:
        from transformers import CONFIG_MAPPING

        hf_config = CONFIG_MAPPING[hf_dict["model_type"]].from_dict(hf_dict)
    return ArchSpec(**meta), hf_config


def _is_distributed(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(p, DistributedOptimizer) for p in parts)


def _materialize_adam_state(optimizer: Any) -> None:
    """Give the never-stepped AdamW state (step 0, zero moments) to parameters that have none yet.

    torch AdamW creates its state at the first update; until then (a) a save writes no optimizer
    tensors, so loading it later fails, and (b) without TE/Apex mcore's
    ``DistributedOptimizer.state_dict()`` reads the per-parameter ``step`` and fails. Zero moments
    with step 0 are exactly what the first update would have created.
    """
    import torch

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                          exp_avg_sq=torch.zeros_like(p))


@contextlib.contextmanager
def _torch_adam_step_passthrough() -> Iterator[None]:
    """Work around mcore's distributed-optimizer load with torch AdamW (no TE/Apex; 0.16 and 0.19).

    ``load_state_dict`` gives every parameter's AdamW state the shared ``step`` tensor, then
    ``load_parameter_state_from_fully_reshardable`` drops ``step`` from the loaded tensors and
    ``_set_main_param_and_optimizer_states`` indexes them by every state key: ``KeyError: 'step'``.
    During the load we hand the parameter's own ``step`` back (copying it onto itself).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def patched(self: Any, model_param: Any, tensors: dict) -> Any:
        group_index, group_order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group_index]["params"][group_order]
        step = self.optimizer.state[main].get("step")
        if step is not None and "step" not in tensors:
            tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = patched
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original


def _unshare_adam_steps(optimizer: Any) -> None:
    """Give every parameter its own AdamW ``step`` tensor after a load.

    mcore's distributed optimizer (no TE/Apex) assigns one shared ``step`` tensor to all parameters;
    torch AdamW increments ``step`` in place per parameter, so a shared tensor would advance once
    per parameter per update and corrupt the bias correction.
    """
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if "step" in state and hasattr(state["step"], "clone"):
                state["step"] = state["step"].clone()


def _common(path: str) -> dict[str, Any]:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    check_files(path)
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except CheckpointingException as err:
        raise CheckpointMismatchError(f"{path}: not an hacrl agent checkpoint ({err})") from err
    except (EOFError, RuntimeError, pickle.UnpicklingError) as err:  # truncated or corrupted common.pt
        raise DamagedCheckpointError(f"{path}: common.pt is damaged ({_reason(err)})") from err
    if _META not in common:
        raise CheckpointMismatchError(f"{path}: not an hacrl agent checkpoint (no {_META!r} entry)")
    return common


def check_compatible(path: str, spec: ArchSpec) -> dict[str, Any]:
    """Read the checkpoint's common state and raise :class:`CheckpointMismatchError` if its model differs."""
    common = _common(path)
    meta = common[_META]
    diffs = [f"{k}: checkpoint {meta.get(k)!r} vs model {getattr(spec, k)!r}" for k in _COMPARED if meta.get(k) != getattr(spec, k)]
    if diffs:
        raise CheckpointMismatchError(f"{path} holds a different model ({meta.get('arch')}): " + "; ".join(diffs))
    return common


def load_checkpoint(path: str, model: Any, optimizer: Any, scheduler: Any, spec: ArchSpec, with_optimizer: bool = True,
                    expected: dict[str, FileDigest] | None = None) -> int:
    """Restore what :func:`save_checkpoint` wrote (at any TP/PP layout); returns the update count.

    ``with_optimizer=False`` loads the weights only (e.g. to start RL from an SFT checkpoint).
    A checkpoint saved before the first update restores a fresh optimizer (it has no state).
    ``expected``: the manifest's digests of the files under ``path``; every file is then hashed as it
    is loaded and a differing one raises :class:`DamagedCheckpointError` naming it.
    """
    from megatron.core import dist_checkpointing

    if expected:
        check_files(path)
        for name in ("common.pt", "metadata.json"):  # read by path, not through torch's reader: small
            check_digest(os.path.join(path, name), expected.get(name))
    common = check_compatible(path, spec)
    meta = common[_META]
    if with_optimizer and not meta.get("has_optimizer", True):
        raise CheckpointMismatchError(f"{path}: holds model weights only (no optimizer state); load it as init_checkpoint")
    saved_dist = meta.get("distributed_optimizer", False)
    if with_optimizer and saved_dist != _is_distributed(optimizer):
        raise CheckpointMismatchError(
            f"{path}: optimizer state was saved with use_distributed_optimizer={saved_dist}, this agent has "
            f"use_distributed_optimizer={not saved_dist}; the two formats do not convert (load weights only, or "
            "set parallel.use_distributed_optimizer to match)"
        )
    restore_state = with_optimizer and meta.get("optimizer_stepped", True)
    if restore_state and saved_dist:
        _materialize_adam_state(optimizer)
    template = _sharded_state(model, optimizer, restore_state, is_loading=True)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name

    with verified_dcp_reads(path, expected) as mismatches:
        try:
            loaded = dist_checkpointing.load(template, path)
        except (EOFError, RuntimeError, AssertionError, pickle.UnpicklingError, CheckpointException) as err:
            named = mismatches[0] if mismatches else _first_failure(err)  # a file that differs from the manifest
            if isinstance(named, DamagedCheckpointError):
                raise named from err
            if isinstance(err, AssertionError):
                raise
            raise DamagedCheckpointError(f"{path}: a .distcp tensor shard or .metadata is damaged "
                                         f"({_reason(err)})") from err  # truncated shard or .metadata
    if mismatches:  # found, though the load went through: its bytes are not the manifest's
        raise mismatches[0]
    model.load_state_dict(loaded["model"])
    if restore_state:
        with _torch_adam_step_passthrough() if saved_dist else contextlib.nullcontext():
            optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
    elif optimizer is not None:
        _reset_optimizer(optimizer, fresh=with_optimizer)
    if with_optimizer:
        scheduler.load_state_dict(common["scheduler"])
    return int(common["updates"]) if with_optimizer else 0


def _first_failure(err: BaseException) -> BaseException:
    """The first rank's error inside torch's CheckpointException (it carries (error, traceback) per
    rank), else ``err`` itself."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        pair = next(iter(failures.values()))
        return pair[0] if isinstance(pair, tuple) else pair
    return err


def _reason(err: BaseException) -> str:
    """One line for a load error; torch's CheckpointException carries (error, traceback) per rank."""
    failures = getattr(err, "failures", None)
    prefix = ""
    if isinstance(failures, dict) and failures:
        rank, pair = next(iter(failures.items()))
        err, prefix = (pair[0] if isinstance(pair, tuple) else pair), f"rank {rank}: "
    text = str(err).strip().splitlines()
    return f"{prefix}{type(err).__name__}" + (f": {text[0]}" if text else "")


def _has_state(optimizer: Any) -> bool:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(len(getattr(p, "optimizer", p).state) > 0 for p in parts)


def _reset_optimizer(optimizer: Any, fresh: bool) -> None:
    """After a weights-only load: copy the new weights into the optimizer's main parameters (mixed
    precision / distributed optimizer) and, for ``fresh``, drop any Adam state (never stepped)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if fresh and getattr(part, "optimizer", None) is not None:
            part.optimizer.state.clear()
        if hasattr(part, "reload_model_params"):
            part.reload_model_params()


class MegatronCheckpointing:
    """The checkpoint methods of the AgentHandle protocol for a megatron-core agent (LocalAgent, and
    through it each Ray rank), over the agent's ``module``, ``optimizer``, ``scheduler``, ``spec``,
    ``updates`` and ``hf_config``. Every rank of the agent makes the same calls (SPMD)."""

    module: Any
    optimizer: Any
    scheduler: Any
    spec: ArchSpec
    updates: int
    hf_config: Any
    _pending_save: PendingSave | None = None

    def save(self, path: str) -> dict[str, FileDigest]:
        """Model + optimizer + scheduler + update count under ``path`` (dist_checkpointing, reshardable)."""
        self.begin_save(path)
        return self.end_save()

    def begin_save(self, path: str, background: bool = False) -> None:
        """Start :meth:`save`: returns once the state is copied for the writer thread (:func:`begin_save`)."""
        enable_cpu_compat()
        if self._pending_save is not None:  # a save the trainer abandoned (its run failed): stop its writer
            self._pending_save.abandon()
        self._pending_save = begin_save(path, self.module, self.optimizer, self.scheduler, self.spec, self.updates,
                                        hf_config=self.hf_config, background=background)

    def end_save(self) -> dict[str, FileDigest]:
        """Finish the save :meth:`begin_save` started; every file's size and SHA-256 (relative paths)."""
        enable_cpu_compat()
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            raise RuntimeError("end_save() without a save begun by begin_save()")
        return pending.finish()

    def load(self, path: str, expected: dict[str, FileDigest] | None = None) -> None:
        """Restore :meth:`save`'s state, possibly written at another TP/PP layout; ``expected``: the
        manifest's digests, checked as the files are read."""
        enable_cpu_compat()
        self.updates = load_checkpoint(path, self.module, self.optimizer, self.scheduler, self.spec, expected=expected)
