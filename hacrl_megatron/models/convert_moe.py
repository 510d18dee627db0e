"""The Mixture-of-Experts part of the HF ↔ Megatron weight conversion (models/convert.py).

Megatron names inside one layer (stage-local layer index, **expert-local** index ``j``; the global
expert is ``e = ep_rank · E/ep + j``):

* router ``mlp.router.weight`` [E, h], replicated over TP (HF ``mlp.gate.weight``; Mixtral on disk
  ``block_sparse_moe.gate.weight``);
* experts, local spec ``mlp.experts.local_experts.{j}.linear_fc{1,2}.weight`` (``SequentialMLP``), TE
  grouped GEMM ``mlp.experts.linear_fc{1,2}.weight{j}``: ``fc1`` = [gate; up] split over the expert
  tensor-parallel group (ETP) like a dense ``fc1`` over TP, ``fc2`` split along its input;
* qwen2_moe's shared expert ``mlp.shared_experts.linear_fc{1,2}.weight`` (split over TP like a
  dense MLP) and its gate ``mlp.shared_experts.gate_weight`` [1, h] (replicated).

HF keeps two layouts of the experts: checkpoints on disk name every expert
(``mlp.experts.{e}.gate_proj.weight`` …; Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2``), while
transformers ≥ 5 holds them in memory as fused 3-D tensors ``mlp.experts.gate_up_proj`` [E, 2f, h]
(gate rows first) and ``mlp.experts.down_proj`` [E, h, f]. The converter works in the disk layout;
:class:`FusedExpertSource` presents an in-memory state dict in it, :func:`fuse_experts` turns an
export stream back into the in-memory layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_TE_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def hf_expert_names(arch: str, e: int) -> tuple[str, str, str]:
    """On-disk (gate, up, down) weight names of expert ``e`` inside ``model.layers.{i}.``."""
    if arch == "mixtral":
        return tuple(f"block_sparse_moe.experts.{e}.{w}.weight" for w in ("w1", "w3", "w2"))  # type: ignore[return-value]
    return tuple(f"mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down"))  # type: ignore[return-value]


def hf_router_name(arch: str) -> str:
    return "block_sparse_moe.gate.weight" if arch == "mixtral" else "mlp.gate.weight"


def expert_of(suffix: str) -> tuple[int, str] | None:
    """(expert-local index, ``linear_fc1`` | ``linear_fc2``) of an expert parameter suffix, else None."""
    m = _LOCAL_EXPERT.match(suffix)
    if m:
        return int(m.group(1)), m.group(2)
    m = _TE_EXPERT.match(suffix)
    return (int(m.group(2)), m.group(1)) if m else None


def moe_layer_rule(spec: Any, suffix: str, expert_offset: int) -> tuple[str, tuple[str, ...], str] | None:
    """(kind, HF suffixes, split group ``tp`` | ``etp``) of an MoE layer parameter, else None."""
    if not spec.is_moe:
        return None
    if suffix == "mlp.router.weight":
        return "rep", (hf_router_name(spec.arch),), "tp"
    expert = expert_of(suffix)
    if expert is not None:
        gate, up, down = hf_expert_names(spec.arch, expert[0] + expert_offset)
        return ("fc1", (gate, up), "etp") if expert[1] == "linear_fc1" else ("col", (down,), "etp")
    shared = {"mlp.shared_experts.linear_fc1.weight": ("fc1", ("mlp.shared_expert.gate_proj.weight",
                                                               "mlp.shared_expert.up_proj.weight"), "tp"),
              "mlp.shared_experts.linear_fc2.weight": ("col", ("mlp.shared_expert.down_proj.weight",), "tp"),
              "mlp.shared_experts.gate_weight": ("rep", ("mlp.shared_expert_gate.weight",), "tp")}
    return shared.get(suffix) if spec.shared_expert_ffn_hidden_size else None


def moe_hf_shape(spec: Any, suffix: str) -> tuple[int, ...] | None:
    """Full HF shape of an MoE tensor suffix inside ``model.layers.{i}.`` (None: not an MoE tensor)."""
    h, f, fs = spec.hidden_size, spec.moe_ffn_hidden_size, spec.shared_expert_ffn_hidden_size
    if suffix == hf_router_name(spec.arch):
        return (spec.num_experts, h)
    m = re.match(r"^(?:mlp|block_sparse_moe)\.experts\.\d+\.(\w+)\.weight$", suffix)
    if m:
        return (h, f) if m.group(1) in ("down_proj", "w2") else (f, h)
    shared = {"mlp.shared_expert.gate_proj.weight": (fs, h), "mlp.shared_expert.up_proj.weight": (fs, h),
              "mlp.shared_expert.down_proj.weight": (h, fs), "mlp.shared_expert_gate.weight": (1, h)}
    return shared.get(suffix)


def expand_expert_suffixes(spec: Any, suffixes: list[str], ep: int) -> list[tuple[str, int | None]]:
    """A stage's per-layer parameter suffixes (this rank's local experts) → (suffix, global expert or
    None) for the whole layer: every expert of every EP rank, in global order, fc1 before fc2."""
    out: list[tuple[str, int | None]] = []
    local = [s for s in suffixes if expert_of(s) is not None]
    placed = False
    per_rank = spec.num_experts // ep if spec.is_moe else 0
    for s in suffixes:
        if expert_of(s) is None:
            out.append((s, None))
        elif not placed:  # all experts at the position of the first one
            by_index = sorted(local, key=lambda x: (expert_of(x)[0], expert_of(x)[1]))  # type: ignore[index]
            for e in range(spec.num_experts):
                out += [(x, e) for x in by_index if expert_of(x)[0] == e % per_rank]  # type: ignore[index]
            placed = True
    return out


def local_expert_suffix(suffix: str, expert: int | None, spec: Any, ep: int) -> str:
    """``suffix`` with its expert-local index set to global ``expert``'s index on its EP rank."""
    if expert is None:
        return suffix
    _, fc = expert_of(suffix)  # type: ignore[misc]
    local = expert % (spec.num_experts // ep)
    if suffix.startswith("mlp.experts.local_experts."):
        return f"mlp.experts.local_experts.{local}.{fc}.weight"
    return f"mlp.experts.{fc}.weight{local}"


class FusedExpertSource:
    """A tensor source whose fused in-memory expert tensors (transformers ≥ 5) appear under their
    on-disk per-expert names; reads only the requested expert (and rows) of a fused tensor."""

    def __init__(self, base: Any, arch: str, num_experts: int) -> None:
        self._base, self._arch = base, arch
        self._virtual: dict[str, tuple[str, int | None, int, int | None]] = {}  # name -> base, expert, row0, rows
        keys = base.keys()
        for key in keys:
            m = _FUSED.match(key)
            if not m:
                continue
            prefix = f"model.layers.{m.group(1)}."
            shape = base.shape(key)
            for e in range(num_experts):
                gate, up, down = hf_expert_names(arch, e)
                if m.group(2) == "gate_up_proj":
                    f = shape[1] // 2
                    self._virtual[prefix + gate] = (key, e, 0, f)
                    self._virtual[prefix + up] = (key, e, f, f)
                else:
                    self._virtual[prefix + down] = (key, e, 0, None)
            if arch == "mixtral" and prefix + "mlp.gate.weight" in keys:
                self._virtual[prefix + hf_router_name(arch)] = (prefix + "mlp.gate.weight", None, 0, None)
        self._hidden = {v[0] for v in self._virtual.values()}

    @staticmethod
    def wraps(base: Any) -> bool:
        """True when ``base`` holds fused expert tensors."""
        return any(_FUSED.match(k) for k in base.keys())

    def keys(self) -> set[str]:
        return (self._base.keys() - self._hidden) | set(self._virtual)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._virtual:
            return self._base.shape(name)
        key, e, _, rows = self._virtual[name]
        full = self._base.shape(key)
        if e is None:
            return tuple(full)
        return (rows if rows is not None else full[1], *full[2:])

    def get(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if name not in self._virtual:
            return self._base.get(name, dim, start, stop)
        key, e, row0, rows = self._virtual[name]
        t = self._base.get(key) if e is None else self._base.get_index(key, e)
        if rows is not None:
            t = t.narrow(0, row0, rows)
        return t if dim is None else t.narrow(dim, start, (stop if stop is not None else t.shape[dim]) - start)

    def get_index(self, name: str, index: int) -> torch.Tensor:
        return self.get(name)[index]


def fuse_experts(stream: Iterable[tuple[str, torch.Tensor]], spec: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """An HF tensor stream in the on-disk layout → the transformers ≥ 5 in-memory layout: each layer's
    per-expert tensors become ``mlp.experts.gate_up_proj`` [E, 2f, h] and ``mlp.experts.down_proj``
    [E, h, f] (yielded once the layer's last expert arrived); Mixtral's router becomes ``mlp.gate``.
    Other tensors pass through unchanged and in order."""
    pattern = re.compile(r"^(model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
    kinds = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
    pending: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    for name, tensor in stream:
        m = pattern.match(name)
        if m is None:
            if spec.arch == "mixtral" and name.endswith("." + hf_router_name("mixtral")):
                name = name.replace("block_sparse_moe.gate.weight", "mlp.gate.weight")
            yield name, tensor
            continue
        prefix = m.group(1)
        parts = pending.setdefault(prefix, {})
        parts[(int(m.group(2)), kinds[m.group(3)])] = tensor
        if len(parts) == 3 * spec.num_experts:
            experts = range(spec.num_experts)
            yield prefix + "mlp.experts.gate_up_proj", torch.stack([torch.cat([parts[(e, 0)], parts[(e, 1)]])
                                                                    for e in experts])
            yield prefix + "mlp.experts.down_proj", torch.stack([parts[(e, 2)] for e in experts])
            del pending[prefix]
    if pending:
        raise ValueError(f"fuse_experts: incomplete experts for {sorted(pending)} (stream ended early)")


def module_layout(named: Iterable[tuple[str, torch.Tensor]], module: torch.nn.Module,
                  spec: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` (an export, per-expert on-disk names) in the parameter names of ``module``: fused
    with :func:`fuse_experts` when ``module`` (a transformers ≥ 5 MoE model) holds fused expert
    tensors, unchanged otherwise (dense models, per-expert modules). What an in-process HF engine
    needs to copy an MoE export into its model by name; ``spec`` defaults to ``module.config``'s."""
    if not any(n.endswith("mlp.experts.gate_up_proj") for n, _ in module.named_parameters()):
        return iter(named)
    if spec is None:
        from hacrl_megatron.models.provider import arch_from_hf

        spec = arch_from_hf(module.config)
    return fuse_experts(named, spec)
