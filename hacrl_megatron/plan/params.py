"""Exact parameter counts per rank of a Megatron layout, computed from the architecture alone.

These are the counts megatron-core's ``GPTModel`` holds on one tensor-parallel rank of each
pipeline stage, as built by :func:`hacrl_megatron.models.provider.build_gpt_model` (the tests
build every stage on the ``meta`` device and compare). Per decoder layer, on one TP rank of ``t``:

* replicated (every TP rank holds the whole tensor): the two RMSNorm weights ``2h``, and for
  qwen3 the per-head query/key norms ``2d``;
* column-parallel (split over ``t``): fused QKV ``(q + 2kv)·h / t`` (+ qwen2's bias ``(q + 2kv)/t``),
  SwiGLU ``fc1`` ``2f·h / t``;
* row-parallel (split over ``t``): attention output ``q·h / t``, ``fc2`` ``f·h / t``;

with ``q = heads·d``, ``kv = kv_heads·d``. The first stage adds the vocab-parallel embedding
``V_pad·h / t``; the last adds the final norm ``h`` and the output layer ``V_pad·h / t`` (a tied
model with one stage shares it; with several stages the last holds a copy). ``V_pad`` is the HF
vocabulary rounded up to a multiple of ``tp`` (the provider's rule, ``vocab_divisible_by = 1``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

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


def layer_params(spec: ArchSpec, tp: int) -> tuple[int, int]:
    """(parameters of one decoder layer on one TP rank, of which replicated across TP)."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    replicated = 2 * h + (2 * d if spec.qk_norm else 0)
    split = (q + 2 * kv) * h + q * h + 3 * f * h + ((q + 2 * kv) if spec.qkv_bias else 0)
    return replicated + split // tp, replicated


def stage_params(spec: ArchSpec, tp: int, pp: int, vocab_divisible_by: int = 1) -> tuple[int, ...]:
    """Parameters of one TP rank of each of the ``pp`` stages (raises ParallelLayoutError when
    ``tp``/``pp`` do not divide heads, KV heads, FFN size or layers)."""
    validate_layout(spec, tp, pp)
    per_layer, _ = layer_params(spec, tp)
    vocab_rows = spec.padded_vocab_size(tp, vocab_divisible_by) // tp
    vocab = vocab_rows * spec.hidden_size
    counts = []
    for stage in range(pp):
        n = per_layer * (spec.num_layers // pp)
        if stage == 0:
            n += vocab
        if stage == pp - 1:
            n += spec.hidden_size  # final norm
            if not spec.tie_embeddings or pp > 1:
                n += vocab
        counts.append(n)
    return tuple(counts)


def rank_params(spec: ArchSpec, tp: int, pp: int, vocab_divisible_by: int = 1) -> RankParams:
    """:class:`RankParams` of one replica; ``all_ranks == hf_total + the three extras`` exactly."""
    per_stage = stage_params(spec, tp, pp, vocab_divisible_by)
    _, replicated = layer_params(spec, tp)
    h = spec.hidden_size
    pad_rows = spec.padded_vocab_size(tp, vocab_divisible_by) - spec.vocab_size
    return RankParams(
        per_stage=per_stage,
        all_ranks=tp * sum(per_stage),
        hf_total=spec.num_parameters(),
        tp_replicated_extra=(tp - 1) * (replicated * spec.num_layers + h),
        vocab_padding_extra=pad_rows * h * (1 if spec.tie_embeddings else 2),
        tied_copy_extra=spec.padded_vocab_size(tp, vocab_divisible_by) * h if spec.tie_embeddings and pp > 1 else 0,
    )


def arch_from_config(config: dict | str) -> ArchSpec:
    """:class:`ArchSpec` from an HF ``config.json`` (a dict, the file, or the model folder holding it).

    Only the configuration is read (no weights, no tokenizer); the dtype is the checkpoint's."""
    import transformers

    if isinstance(config, str):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{config}: no HF config.json here (give a model folder or its config.json)")
        with open(path) as f:
            config = json.load(f)
    data = dict(config)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"HF config has no 'model_type' (keys: {sorted(config)[:8]}...)")
    return arch_from_hf(transformers.AutoConfig.for_model(model_type, **data))
