"""HF ↔ Megatron weight conversion with tensor- and pipeline-parallel sharding, streamed.

Import (:func:`load_hf_weights`): every rank walks its own parameters and reads from the HF
checkpoint only the rows/columns of its shard (``safe_open(...).get_slice``), one tensor at a time,
so a 70B model never sits whole in one rank's memory. Export (``models/export.py``:
``export_hf_weights``): one parameter at a time, the owning pipeline stage gathers the TP shards, turns
them into HF tensors (full size, unpadded vocab, :func:`_to_hf`) and broadcasts them to the other
stages; every rank yields the same ``(hf_name, tensor)`` stream, which is what rollout engines receive
(docs/architecture.md, "Engines speak HF names"). ``export.export_stage_hf_weights`` yields one stage's
share on that stage only (the stage-parallel weight sync, ``sync/stages.py``).

Layout facts this relies on (megatron-core GPTModel, local and TE specs):

* ``linear_qkv`` rows are grouped per KV head (query group): for each group, its
  ``heads/kv_heads`` query heads, then its key head, then its value head, each ``head_dim`` rows.
  TP splits the groups contiguously, so rank r holds groups ``[r·G/tp, (r+1)·G/tp)``.
* ``linear_fc1`` is ``[gate; up]`` per TP rank (each rank holds its slice of gate then of up).
* ``linear_proj`` / ``linear_fc2`` are row-parallel: TP splits the input (column) dimension.
* The (padded) vocabulary is split contiguously; rows past the HF vocab are zero.
* Local spec names ``input_layernorm`` / ``pre_mlp_layernorm``; TE spec fuses them as
  ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``; both map to the same HF names.
* Parameter names use stage-local layer indices; global index = the stage's first layer + local
  index (stages may hold uneven layer counts, ``config/layout.pipeline_layers``).
* MoE layers (models/convert_moe.py): the router is replicated over TP; experts are split over EP
  (whole experts, expert-local indices) and each expert over the expert tensor-parallel group (ETP)
  like a dense MLP over TP; HF's fused in-memory expert tensors are read through
  :class:`~hacrl_megatron.models.convert_moe.FusedExpertSource`, the export uses the per-expert
  on-disk names (what checkpoints, SGLang and ``from_pretrained`` read).
"""

from __future__ import annotations

import abc
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hacrl_megatron.config.layout import layer_offset as _stage_offset
from hacrl_megatron.errors import InputError
from hacrl_megatron.models.convert_moe import (
    FusedExpertSource,
    moe_hf_shape,
    moe_layer_rule,
)
from hacrl_megatron.models.provider import DTYPES, ArchSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# megatron suffix inside a layer -> (kind, HF suffixes inside model.layers.{i}.)
_LAYER_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("rep", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("rep", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": ("qkv", tuple(f"self_attn.{p}_proj.weight" for p in "qkv")),
    "self_attention.linear_qkv.bias": ("qkv", tuple(f"self_attn.{p}_proj.bias" for p in "qkv")),
    "self_attention.q_layernorm.weight": ("rep", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("rep", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("col", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("rep", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("rep", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("col", ("mlp.down_proj.weight",)),
}


class CheckpointMismatchError(ValueError):
    """An HF checkpoint does not fit the Megatron model (missing tensor, wrong shape, other arch)."""


class CorruptCheckpointError(CheckpointMismatchError, InputError):
    """A checkpoint file that cannot be read (damaged or truncated safetensors, a broken index);
    the message names the file."""


@dataclass(frozen=True)
class Plan:
    """How one Megatron parameter is made from HF tensors: ``kind`` and the HF names in order."""

    kind: str  # rep | col | qkv | fc1 | vocab
    hf_names: tuple[str, ...]
    split: str = "tp"  # the group that shards it: tp, or etp (routed experts)


def plan_for(spec: ArchSpec, name: str, layer_offset: int, expert_offset: int = 0) -> Plan:
    """Plan for Megatron parameter ``name`` (stage-local) on a stage whose first layer is ``layer_offset``
    (an expert parameter's local index + ``expert_offset`` is its global expert)."""
    m = _LAYER.match(name)
    if m:
        moe = moe_layer_rule(spec, m.group(2), expert_offset)
        rule = (*moe[:2],) if moe else _LAYER_RULES.get(m.group(2))
        if rule is None or (spec.is_moe and m.group(2).startswith("mlp.linear_fc")):
            raise CheckpointMismatchError(f"no HF mapping for Megatron parameter {name!r} ({spec.arch})")
        prefix = f"model.layers.{int(m.group(1)) + layer_offset}."
        return Plan(rule[0], tuple(prefix + s for s in rule[1]), moe[2] if moe else "tp")
    if name == "embedding.word_embeddings.weight":
        return Plan("vocab", ("model.embed_tokens.weight",))
    if name == "output_layer.weight":
        return Plan("vocab", ("model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight",))
    if name == "decoder.final_layernorm.weight":
        return Plan("rep", ("model.norm.weight",))
    raise CheckpointMismatchError(f"no HF mapping for Megatron parameter {name!r} ({spec.arch})")


# --------------------------------------------------------------------------------------------
# HF tensor sources


class TensorSource(abc.ABC):
    """Named HF tensors with optional contiguous slicing along dim 0 or 1 (read only that part)."""

    @abc.abstractmethod
    def keys(self) -> set[str]:
        """Names of all tensors."""

    @abc.abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor ``name``."""

    @abc.abstractmethod
    def get(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or only rows/columns [start, stop) along ``dim``."""

    def get_index(self, name: str, index: int) -> torch.Tensor:
        """``tensor[index]`` of tensor ``name`` (one expert of a fused 3-D expert tensor)."""
        return self.get(name)[index]


class DictSource(TensorSource):
    """An in-memory HF state dict (e.g. a model loaded from GGUF by transformers)."""

    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._sd = state_dict

    def keys(self) -> set[str]:
        return set(self._sd)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._sd[name].shape)

    def get(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        t = self._sd[name]
        return t if dim is None else t.narrow(dim, start, (stop if stop is not None else t.shape[dim]) - start)

    def get_index(self, name: str, index: int) -> torch.Tensor:
        return self._sd[name][index]


def open_safetensors(fname: str) -> Any:
    """``safe_open(fname)``; a damaged file raises :class:`CorruptCheckpointError` naming it
    (safetensors' own errors, e.g. "invalid UTF-8 in header", do not say which file)."""
    from safetensors import safe_open

    try:
        return safe_open(fname, framework="pt")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{fname}: safetensors file listed by the checkpoint is missing") from None
    except Exception as err:  # SafetensorError, OSError: header unreadable or file shorter than it says
        raise CorruptCheckpointError(
            f"{fname}: not a readable safetensors file ({type(err).__name__}: {err}); the file is damaged or "
            "truncated: copy or convert it again"
        ) from None


class SafetensorsSource(TensorSource):
    """An HF checkpoint directory (``model.safetensors`` or an index of shards), read lazily.

    Every shard's header is read up front, so a damaged or missing file is named before any
    conversion work starts (:class:`CorruptCheckpointError`).
    """

    def __init__(self, path: str) -> None:
        index = os.path.join(path, "model.safetensors.index.json")
        self._handles: dict[str, Any] = {}
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
                raise CorruptCheckpointError(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from None
            self._file = {k: os.path.join(path, v) for k, v in weight_map.items()}
            for fname in sorted(set(self._file.values())):
                self._handles[fname] = open_safetensors(fname)
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"{path}: no *.safetensors files (and no model.safetensors.index.json)")
            self._file = {}
            for fname in files:
                full = os.path.join(path, fname)
                self._handles[full] = open_safetensors(full)
                self._file.update(dict.fromkeys(self._handles[full].keys(), full))

    def _slice(self, name: str) -> Any:
        fname = self._file[name]
        if fname not in self._handles:
            self._handles[fname] = open_safetensors(fname)
        return self._handles[fname].get_slice(name)

    def keys(self) -> set[str]:
        return set(self._file)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def get(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        sl = self._slice(name)
        if dim is None:
            return sl[:]
        stop = stop if stop is not None else sl.get_shape()[dim]
        return sl[start:stop] if dim == 0 else sl[:, start:stop]

    def get_index(self, name: str, index: int) -> torch.Tensor:
        return self._slice(name)[index : index + 1][0]  # reads only that expert


def as_source(src: str | dict[str, torch.Tensor] | TensorSource, spec: ArchSpec | None = None) -> TensorSource:
    """A :class:`TensorSource` over ``src``; with an MoE ``spec``, fused in-memory expert tensors are
    presented under their per-expert on-disk names."""
    if isinstance(src, dict):
        src = DictSource(src)
    elif not isinstance(src, TensorSource):
        src = SafetensorsSource(str(src))
    if spec is not None and spec.is_moe and FusedExpertSource.wraps(src):
        return FusedExpertSource(src, spec.arch, spec.num_experts)  # type: ignore[return-value]
    return src


# --------------------------------------------------------------------------------------------
# HF -> Megatron (one shard)


def hf_shape(spec: ArchSpec, hf_name: str) -> tuple[int, ...]:
    """Full HF shape of ``hf_name`` for ``spec`` (used to check checkpoints and to receive broadcasts)."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    table = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (spec.vocab_size, h)
    if hf_name == "model.norm.weight":
        return (h,)
    suffix = hf_name.split(".", 3)[3]
    shape = moe_hf_shape(spec, suffix) if spec.is_moe else None
    return shape if shape is not None else table[suffix]


def _qkv_shard(spec: ArchSpec, src: TensorSource, names: tuple[str, ...], r: int, tp: int) -> torch.Tensor:
    d, groups = spec.head_dim, spec.num_kv_heads // tp
    qpg = spec.num_heads // spec.num_kv_heads
    g0 = r * groups
    q = src.get(names[0], 0, g0 * qpg * d, (g0 + groups) * qpg * d)
    k = src.get(names[1], 0, g0 * d, (g0 + groups) * d)
    v = src.get(names[2], 0, g0 * d, (g0 + groups) * d)
    rest = q.shape[1:]
    parts = [q.reshape(groups, qpg * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _vocab_shard(spec: ArchSpec, src: TensorSource, name: str, rows: int, r: int) -> torch.Tensor:
    start = r * rows
    stop = min(start + rows, spec.vocab_size)
    out = torch.zeros(rows, spec.hidden_size, dtype=DTYPES[spec.dtype])
    if stop > start:
        out[: stop - start] = src.get(name, 0, start, stop)
    return out


def megatron_shard(spec: ArchSpec, plan: Plan, src: TensorSource, local_shape: tuple[int, ...], r: int, tp: int) -> torch.Tensor:
    """This TP rank's shard of one Megatron parameter, built from the HF tensors of ``plan``."""
    for n in plan.hf_names:
        if n not in src.keys():
            raise CheckpointMismatchError(f"HF checkpoint has no tensor {n!r} needed by the {spec.arch} model")
        if src.shape(n) != hf_shape(spec, n):
            raise CheckpointMismatchError(
                f"HF tensor {n!r} has shape {src.shape(n)}, the {spec.arch} model expects {hf_shape(spec, n)}"
            )
    names = plan.hf_names
    if plan.kind == "rep":
        return src.get(names[0])
    if plan.kind == "col":
        n = src.shape(names[0])[1] // tp
        return src.get(names[0], 1, r * n, (r + 1) * n)
    if plan.kind == "qkv":
        return _qkv_shard(spec, src, names, r, tp)
    if plan.kind == "fc1":  # gate and up rows of a dense MLP (over tp) or of one expert (over etp)
        n = src.shape(names[0])[0] // tp
        return torch.cat([src.get(names[0], 0, r * n, (r + 1) * n), src.get(names[1], 0, r * n, (r + 1) * n)])
    return _vocab_shard(spec, src, names[0], local_shape[0], r)


def unwrap(model: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def layer_offset(spec: ArchSpec, pp_rank: int, pp: int) -> int:
    """Global index of the first layer of pipeline stage ``pp_rank``."""
    return _stage_offset(spec.num_layers, pp, pp_rank)


def _split_ranks() -> dict[str, tuple[int, int]]:
    """(rank, size) of this rank in the tensor-parallel and the expert tensor-parallel group."""
    from megatron.core import parallel_state as mpu

    return {"tp": (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()),
            "etp": (mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size())}


def _expert_offset(spec: ArchSpec) -> int:
    from megatron.core import parallel_state as mpu

    return mpu.get_expert_model_parallel_rank() * (spec.num_experts // mpu.get_expert_model_parallel_world_size())


@torch.no_grad()
def load_hf_weights(model: Any, spec: ArchSpec, source: str | dict[str, torch.Tensor] | TensorSource) -> int:
    """Copy an HF checkpoint into this rank's Megatron ``model`` shard; returns #parameters loaded.

    ``source``: an HF directory with safetensors, an HF state dict, or a :class:`TensorSource`.
    Every parameter of the model must be covered (a checkpoint of another architecture or size
    raises :class:`CheckpointMismatchError` naming the first tensor that does not fit).
    """
    from megatron.core import parallel_state as mpu

    src = as_source(source, spec)
    splits = _split_ranks()
    offset = layer_offset(spec, mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size())
    experts = _expert_offset(spec) if spec.is_moe else 0
    count = 0
    for name, param in unwrap(model).named_parameters():
        plan = plan_for(spec, name, offset, experts)
        shard = megatron_shard(spec, plan, src, tuple(param.shape), *splits[plan.split])
        if tuple(shard.shape) != tuple(param.shape):
            raise CheckpointMismatchError(
                f"{name}: HF {plan.hf_names} give a shard of shape {tuple(shard.shape)}, the model has {tuple(param.shape)}"
            )
        param.copy_(shard.to(param.dtype))
        count += 1
    return count


# --------------------------------------------------------------------------------------------
# Megatron -> HF (streamed, one parameter at a time)


def _to_hf(spec: ArchSpec, plan: Plan, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gathered TP shards (rank order) of one Megatron parameter → its full HF tensors."""
    if plan.kind == "rep":
        return [shards[0].clone()]
    if plan.kind == "col":
        return [torch.cat(shards, dim=1)]
    if plan.kind == "vocab":  # one copy: the padded rows are cut from the shards before joining them
        rows = shards[0].shape[0]
        return [torch.cat([s[: max(0, min(rows, spec.vocab_size - i * rows))] for i, s in enumerate(shards)])]
    if plan.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    d, qpg = spec.head_dim, spec.num_heads // spec.num_kv_heads
    q, k, v = [], [], []
    for s in shards:
        rest = s.shape[1:]
        grouped = s.reshape(-1, (qpg + 2) * d, *rest)
        q.append(grouped[:, : qpg * d].reshape(-1, *rest))
        k.append(grouped[:, qpg * d : (qpg + 1) * d].reshape(-1, *rest))
        v.append(grouped[:, (qpg + 1) * d :].reshape(-1, *rest))
    return [torch.cat(q), torch.cat(k), torch.cat(v)]


def save_hf_checkpoint(
    tensors: Iterator[tuple[str, torch.Tensor]], hf_config: Any, out_dir: str, max_shard_bytes: int = 2 << 30
) -> list[str]:
    """Write ``save_pretrained``-compatible ``config.json`` + safetensors shards from a tensor stream.

    Holds at most ``max_shard_bytes`` of tensors in memory. Returns the written file names.
    """
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    hf_config.save_pretrained(out_dir)
    files: list[str] = []
    weight_map: dict[str, str] = {}
    bucket: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        fname = f"model-{len(files) + 1:05d}.safetensors"
        save_file({k: v.contiguous().cpu() for k, v in bucket.items()}, os.path.join(out_dir, fname),
                  metadata={"format": "pt"})
        # safetensors creates its files 0600; a deployable folder is readable like its config.json (0644)
        os.chmod(os.path.join(out_dir, fname), os.stat(os.path.join(out_dir, "config.json")).st_mode & 0o777)
        files.append(fname)
        weight_map.update(dict.fromkeys(bucket, fname))
        bucket, size = {}, 0

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_shard_bytes:  # flush first: a bucket never exceeds the limit
            flush()  # (or one tensor larger than it); writing it briefly doubles it (safetensors' bytes)
        bucket[name] = tensor
        size += nbytes
    if bucket:
        flush()
    if len(files) == 1:
        os.replace(os.path.join(out_dir, files[0]), os.path.join(out_dir, "model.safetensors"))
        return ["config.json", "model.safetensors"]
    total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in files)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return ["config.json", *files, "model.safetensors.index.json"]
