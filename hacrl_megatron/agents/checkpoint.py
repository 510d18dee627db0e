"""Reshardable agent checkpoints with megatron-core ``dist_checkpointing``.

A checkpoint holds the model, the optimizer (Adam moments, per parameter shard), the LR scheduler
and the number of updates, plus ``hacrl_meta``: the model's :class:`ArchSpec` as a dict, checked on
load so that a checkpoint of another architecture or size fails with a message naming the fields
that differ (instead of a shape error deep inside megatron). Tensors are saved as global
ShardedTensors, so a checkpoint written at TP = 2 / PP = 2 loads at TP = 1 / PP = 1 and back.

Atomicity: :func:`save_checkpoint` writes into the directory it is given. The trainer writes the
joint checkpoint of all agents into a temporary directory and renames the whole directory when
every agent has finished, so a crash never leaves a half-written checkpoint behind.

Note: megatron's ``torch_dist`` writer starts a ``spawn`` multiprocessing Manager, so a script that
saves must guard its entry point with ``if __name__ == "__main__":`` (console scripts and pytest do).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from hacrl_megatron.models.convert import CheckpointMismatchError
from hacrl_megatron.models.provider import ArchSpec

_META = "hacrl_meta"
_COMPARED = ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
             "vocab_size", "tie_embeddings", "qkv_bias", "qk_norm")


def _sharded_state(model: Any, optimizer: Any, with_optimizer: bool, is_loading: bool) -> dict[str, Any]:
    model_sd = model.sharded_state_dict()
    state: dict[str, Any] = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return state


def save_checkpoint(path: str, model: Any, optimizer: Any, scheduler: Any, spec: ArchSpec, updates: int) -> None:
    """Write model + optimizer + scheduler + update count under ``path`` (created if missing).

    Collective: every rank of the agent calls it.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    state = _sharded_state(model, optimizer, True, is_loading=False)
    state["scheduler"] = scheduler.state_dict()
    state["updates"] = int(updates)
    state[_META] = dataclasses.asdict(spec)
    dist_checkpointing.save(state, path)


def check_compatible(path: str, spec: ArchSpec) -> dict[str, Any]:
    """Read the checkpoint's common state and raise :class:`CheckpointMismatchError` if its model differs."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    common = dist_checkpointing.load_common_state_dict(path)
    meta = common.get(_META)
    if meta is None:
        raise CheckpointMismatchError(f"{path}: not an hacrl agent checkpoint (no {_META!r} entry)")
    diffs = [f"{k}: checkpoint {meta.get(k)!r} vs model {getattr(spec, k)!r}" for k in _COMPARED if meta.get(k) != getattr(spec, k)]
    if diffs:
        raise CheckpointMismatchError(f"{path} holds a different model ({meta.get('arch')}): " + "; ".join(diffs))
    return common


def load_checkpoint(path: str, model: Any, optimizer: Any, scheduler: Any, spec: ArchSpec, with_optimizer: bool = True) -> int:
    """Restore what :func:`save_checkpoint` wrote (at any TP/PP layout); returns the update count.

    ``with_optimizer=False`` loads the weights only (e.g. to start RL from an SFT checkpoint).
    """
    from megatron.core import dist_checkpointing

    common = check_compatible(path, spec)
    template = _sharded_state(model, optimizer, with_optimizer, is_loading=True)
    loaded = dist_checkpointing.load(template, path)
    model.load_state_dict(loaded["model"])
    if with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(common["scheduler"])
    return int(common["updates"]) if with_optimizer else 0
