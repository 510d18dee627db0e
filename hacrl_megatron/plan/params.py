"""Exact parameter counts per rank of a Megatron layout, computed from the architecture alone.

These are the counts megatron-core's ``GPTModel`` holds on one tensor-parallel rank of each
pipeline stage, as built by :func:`hacrl_megatron.models.provider.build_gpt_model` (the tests
build every stage on the ``meta`` device and compare). Per decoder layer, on one TP rank of ``t``:

* replicated (every TP rank holds the whole tensor): the two RMSNorm weights ``2h``, and for
  qwen3 the per-head query/key norms ``2d``;
* column-parallel (split over ``t``): fused QKV ``(q + 2kv)·h / t`` (+ qwen2's bias ``(q + 2kv)/t``),
  SwiGLU ``fc1`` ``2f·h / t``;
* row-parallel (split over ``t``): attention output ``q·h / t``, ``fc2`` ``f·h / t``;

with ``q = heads·d``, ``kv = kv_heads·d``. An MoE layer replaces the SwiGLU by a router ``E·h``
replicated over TP (each TP rank routes its sequence-parallel slice with the whole router), the
``E / ep`` experts of this expert-parallel rank, each ``3·h·f_e / etp`` (the expert tensor-parallel
split), and for qwen2_moe a shared expert ``3·h·f_s / t`` (TP like a dense MLP) with its gate ``h``
(replicated). Stages may hold uneven layer counts (``config/layout.pipeline_layers``).

The first stage adds the vocab-parallel embedding
``V_pad·h / t``; the last adds the final norm ``h`` and the output layer ``V_pad·h / t`` (a tied
model with one stage shares it; with several stages the last holds a copy). ``V_pad`` is the HF
vocabulary rounded up to a multiple of ``tp`` (the provider's rule, ``vocab_divisible_by = 1``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hacrl_megatron.config.layout import pipeline_layers
from hacrl_megatron.errors import one_line_text
from hacrl_megatron.models.provider import ArchSpec, arch_from_hf, validate_layout


@dataclass(frozen=True)
class RankParams:
    """Parameters held by one TP rank of every pipeline stage (in stage order) and their sum
    over all ``tp·pp`` ranks of one model replica, with how that sum relates to the HF count."""

    per_stage: tuple[int, ...]
    all_ranks: int
    hf_total: int
    tp_replicated_extra: int  # (tp − 1) × the replicated norm weights: each TP rank has its own copy
    vocab_padding_extra: int  # rows added by padding the vocabulary × h, per vocab matrix (tied: one)
    tied_copy_extra: int  # a tied embedding's copy on the last stage when pp > 1 (V_pad·h)


def layer_params(spec: ArchSpec, tp: int, ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """(parameters of one decoder layer on one TP rank, of which replicated across TP)."""
    dense, experts, replicated = layer_param_split(spec, tp, ep, etp)
    return dense + experts, replicated


def layer_param_split(spec: ArchSpec, tp: int, ep: int = 1, etp: int = 1) -> tuple[int, int, int]:
    """(non-expert parameters of one layer on one rank, routed-expert parameters on it, the part of
    the non-expert ones replicated across TP). The experts' optimizer state is sharded over the
    expert-data-parallel group, the rest over data parallelism (plan/memory.py)."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    replicated = 2 * h + (2 * d if spec.qk_norm else 0)
    split = (q + 2 * kv) * h + q * h + ((q + 2 * kv) if spec.qkv_bias else 0)
    if not spec.is_moe:
        return replicated + (split + 3 * f * h) // tp, 0, replicated
    fs = spec.shared_expert_ffn_hidden_size
    replicated += spec.num_experts * h + (h if fs else 0)  # router, shared-expert gate
    experts = spec.num_experts // ep * 3 * h * spec.moe_ffn_hidden_size // etp
    return replicated + (split + 3 * fs * h) // tp, experts, replicated


def stage_param_split(spec: ArchSpec, tp: int, pp: int, vocab_divisible_by: int = 1, ep: int = 1,
                      etp: int = 1) -> tuple[tuple[int, int], ...]:
    """(non-expert, expert) parameters of one rank of each of the ``pp`` stages (raises
    ParallelLayoutError when the layout does not fit heads, KV heads, FFN size, layers or experts)."""
    validate_layout(spec, tp, pp, ep, etp)
    dense, experts, _ = layer_param_split(spec, tp, ep, etp)
    vocab_rows = spec.padded_vocab_size(tp, vocab_divisible_by) // tp
    vocab = vocab_rows * spec.hidden_size
    counts = []
    for stage, layers in enumerate(pipeline_layers(spec.num_layers, pp)):
        n = dense * layers
        if stage == 0:
            n += vocab
        if stage == pp - 1:
            n += spec.hidden_size  # final norm
            if not spec.tie_embeddings or pp > 1:
                n += vocab
        counts.append((n, experts * layers))
    return tuple(counts)


def stage_params(spec: ArchSpec, tp: int, pp: int, vocab_divisible_by: int = 1, ep: int = 1,
                 etp: int = 1) -> tuple[int, ...]:
    """Parameters of one rank of each of the ``pp`` stages (see :func:`stage_param_split`)."""
    return tuple(d + e for d, e in stage_param_split(spec, tp, pp, vocab_divisible_by, ep, etp))


def rank_params(spec: ArchSpec, tp: int, pp: int, vocab_divisible_by: int = 1, ep: int = 1,
                etp: int = 1) -> RankParams:
    """:class:`RankParams` of one replica; ``all_ranks == hf_total + the three extras`` exactly.

    A replica is the ``tp`` ranks of every stage for the non-expert parameters and the ``ep·etp``
    ranks that hold one copy of every expert."""
    split = stage_param_split(spec, tp, pp, vocab_divisible_by, ep, etp)
    per_stage = tuple(d + e for d, e in split)
    _, replicated = layer_params(spec, tp, ep, etp)
    h = spec.hidden_size
    pad_rows = spec.padded_vocab_size(tp, vocab_divisible_by) - spec.vocab_size
    return RankParams(
        per_stage=per_stage,
        all_ranks=tp * sum(d for d, _ in split) + ep * etp * sum(e for _, e in split),
        hf_total=spec.num_parameters(),
        tp_replicated_extra=(tp - 1) * (replicated * spec.num_layers + h),
        vocab_padding_extra=pad_rows * h * (1 if spec.tie_embeddings else 2),
        tied_copy_extra=spec.padded_vocab_size(tp, vocab_divisible_by) * h if spec.tie_embeddings and pp > 1 else 0,
    )


def arch_from_config(config: dict | str) -> ArchSpec:
    """:class:`ArchSpec` from an HF ``config.json`` (a dict, the file, or the model folder holding it).

    Only the configuration is read (no weights, no tokenizer); the dtype is the checkpoint's."""
    import transformers

    where = "HF config"
    if isinstance(config, str):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{config}: no HF config.json here (give a model folder or its config.json)")
        where = path
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (ValueError, RecursionError) as err:  # JSONDecodeError, not UTF-8, 4,300+ digit integers
            raise ValueError(f"{path}: not a readable JSON config ({one_line_text(str(err), 200)})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(config).__name__}")
    data = dict(config)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{where}: no 'model_type' (keys: {sorted(config)[:8]}...)")
    try:  # transformers validates some fields itself (its own error types, or 0 heads dividing), arch_from_hf the rest
        hf = transformers.AutoConfig.for_model(model_type, **data)
    except Exception as err:
        raise ValueError(f"{where}: {one_line_text(str(err))}") from None
    try:
        return arch_from_hf(hf)
    except ValueError as err:
        raise type(err)(f"{where}: {err}") from None
