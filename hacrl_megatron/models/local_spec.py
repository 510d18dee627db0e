"""megatron-core's local layer spec (the one that runs on CPU) with a sequence-parallel-capable RMSNorm.

The local spec builds its norms with ``WrappedTorchNorm``, which asserts
``not config.sequence_parallel`` (megatron-core ``transformer/torch_norm.py``): a torch norm has no
notion of its weight's gradient being a partial sum. Under sequence parallelism each tensor-parallel
rank normalises only its slice of the sequence, so the norm weight's gradient on one rank covers only
those tokens and must be summed over the TP group. megatron-core does that sum in
``finalize_model_grads`` for every parameter marked ``sequence_parallel`` (what its TE and Apex
norms set); :class:`RMSNorm` is ``torch.nn.RMSNorm`` with that mark. MoE layers with TP > 1 need
sequence parallelism (the router and the token dispatcher work on each rank's slice), so this is
what lets TP·EP·SP layouts run on CPU (docs/cpu_compat.md); numerics are torch's RMSNorm's, bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built from megatron's norm signature, its weight marked ``sequence_parallel``
    when the config uses sequence parallelism (megatron then all-reduces its gradient over TP)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm") -> None:
        if normalization != "RMSNorm" or getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"RMSNorm: normalization={normalization!r} / {config.normalization!r} (only RMSNorm)")
        if zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError("RMSNorm: zero-centred gamma is not supported")
        super().__init__(hidden_size, eps=eps)  # float32 weight, as WrappedTorchNorm makes it
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def _replace_norms(spec: Any) -> Any:
    """A copy of a ``ModuleSpec`` tree with every ``WrappedTorchNorm`` replaced by :class:`RMSNorm`."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return RMSNorm
    if isinstance(spec, ModuleSpec):
        module = RMSNorm if spec.module is WrappedTorchNorm else spec.module
        return dataclasses.replace(spec, module=module, submodules=_replace_norms(spec.submodules))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _replace_norms(getattr(spec, f.name))
                                            for f in dataclasses.fields(spec)})
    return spec


def local_block_spec(layer: Any, num_layers: int) -> Any:
    """``TransformerBlockSubmodules`` of ``num_layers`` copies of the local ``layer`` spec with
    :class:`RMSNorm` everywhere (the layers' norms, QK-norms and the block's final norm)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = _replace_norms(layer)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=RMSNorm)
