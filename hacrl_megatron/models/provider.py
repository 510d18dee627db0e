"""HF config → megatron-core ``GPTModel`` for the decoder families HACRL trains, dense and MoE.

One path: :func:`arch_from_hf` reads an HF ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` (or one
of the MoE configs of :mod:`hacrl_megatron.models.moe`) into an :class:`ArchSpec`; our :class:`hacrl_megatron.config.ModelConfig` first becomes an HF config
(:func:`hf_config_from_model_config`) and then takes the same path. :func:`build_gpt_model` makes
the Megatron model for one pipeline stage of one tensor-parallel rank.

Family differences handled here (everything else is shared: RMSNorm, SwiGLU, RoPE, GQA):

* qwen2: bias on the fused QKV projection (``add_qkv_bias``);
* qwen3: per-head RMSNorm on queries and keys (``qk_layernorm``), explicit ``head_dim``;
* llama: optional llama3 RoPE scaling (Llama-3.x checkpoints);
* qwen3_moe / mixtral / qwen2_moe: the attention of qwen3 / llama / qwen2 with routed experts in
  every layer (qwen2_moe adds a sigmoid-gated shared expert), :mod:`hacrl_megatron.models.moe`.

Layer spec: Transformer Engine's when TE imports and CUDA is present, else megatron-core's local
spec (the only one that runs on CPU, docs/measured.md §2) with a sequence-parallel-capable RMSNorm
(:mod:`hacrl_megatron.models.local_spec`). Pipeline stages may hold uneven layer counts
(:func:`hacrl_megatron.config.layout.pipeline_layers`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from hacrl_megatron.accelerators import transformer_engine_available
from hacrl_megatron.config.layout import LayoutError, pipeline_layers, uneven_stage_sizes
from hacrl_megatron.config.schema import AUTO_DTYPE
from hacrl_megatron.models.dtype import FLOAT32, checkpoint_dtype, resolve_model_dtype
from hacrl_megatron.models.moe import (
    ATTENTION_OF,
    MOE_MODEL_TYPES,
    MoESettings,
    hf_moe_config,
    moe_fields_from_hf,
    moe_transformer_kwargs,
)

ARCH_BY_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", **MOE_MODEL_TYPES}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RECOMPUTE = ("none", "selective", "full")


class UnsupportedModelError(ValueError):
    """The HF checkpoint or config uses a feature this provider cannot map to Megatron."""


class ParallelLayoutError(ValueError):
    """The requested TP/PP layout does not fit the model (heads, KV heads or layers)."""


@dataclass(frozen=True)
class ArchSpec:
    """Everything the provider and the weight converter need to know about one model.

    Sizes are in elements; ``vocab_size`` is the HF vocabulary (rows of ``embed_tokens``).
    """

    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling_factor: float | None = None  # llama3-style RoPE scaling, None = off
    dtype: str = "float32"
    hf_architecture: str = field(default="", compare=False)
    # Mixture of Experts (0 experts: dense); every layer is an MoE layer
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0  # each routed expert's SwiGLU width
    shared_expert_ffn_hidden_size: int = 0  # qwen2_moe's shared expert (0: none)
    norm_topk_prob: bool = True  # top-k probabilities renormalised (megatron: moe_router_pre_softmax=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def padded_vocab_size(self, tp: int, divisible_by: int = 1) -> int:
        """Rows of Megatron's (vocab-parallel) embedding: the HF vocab rounded up to a multiple of
        ``divisible_by * tp`` (Megatron's ``make_vocab_size_divisible_by``). The default 1 pads only
        when ``tp`` does not divide the vocab, so logits equal HF's without masking in most cases.
        """
        multiple = divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self) -> int:
        """Parameter count as HF reports it (unpadded vocab; tied embeddings counted once)."""
        h, d, f = self.hidden_size, self.head_dim, self.ffn_hidden_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        layer = 2 * h + h * (q + 2 * kv) + q * h + (self.moe_layer_mlp_params() if self.is_moe else 3 * h * f)
        layer += (q + 2 * kv) if self.qkv_bias else 0
        layer += 2 * d if self.qk_norm else 0
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return embed + h + self.num_layers * layer

    def moe_layer_mlp_params(self) -> int:
        """An MoE layer's MLP as HF counts it: router ``E·h``, experts ``E·3·h·f_e``, shared expert
        ``3·h·f_s`` and its gate ``h``."""
        h, e, fs = self.hidden_size, self.num_experts, self.shared_expert_ffn_hidden_size
        return e * h + e * 3 * h * self.moe_ffn_hidden_size + (3 * h * fs + h if fs else 0)

    def active_parameters(self) -> int:
        """Parameters one token passes through (MoE: the top-k experts instead of all), HF counting."""
        if not self.is_moe:
            return self.num_parameters()
        h, e, k = self.hidden_size, self.num_experts, self.moe_topk
        return self.num_parameters() - self.num_layers * (e - k) * 3 * h * self.moe_ffn_hidden_size


# --------------------------------------------------------------------------------------------
# HF config ↔ ArchSpec


def _rope_params(cfg: Any) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None)  # transformers >= 5
    if params is None:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return dict(params)


def _llama3_factor(cfg: Any, rope: dict[str, Any]) -> float | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise UnsupportedModelError(f"rope_type={kind!r} is not supported (only 'default' and 'llama3')")
    # megatron-core hard-codes low=1, high=4, original=8192 (RotaryEmbedding._apply_scaling)
    expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for key, value in expected.items():
        if float(rope.get(key, value)) != value:
            raise UnsupportedModelError(f"llama3 RoPE {key}={rope.get(key)} is not supported (megatron-core fixes {value})")
    return float(rope["factor"])


_HF_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "vocab_size", "max_position_embeddings")
MAX_HF_SIZE = 2**31 - 1  # any size beyond int32 is no model anyone can build


def check_hf_sizes(cfg: Any) -> None:
    """Every size an :class:`ArchSpec` reads from an HF config is an integer in [1, 2**31) (absent
    optional ones aside): a float (1e300), 0 heads or a string would crash later, deep in the maths.
    Raises :class:`UnsupportedModelError` naming the field and its value."""
    for name in _HF_SIZES:
        value = getattr(cfg, name, None)
        if value is None and name in ("num_key_value_heads", "head_dim"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_HF_SIZE:
            raise UnsupportedModelError(f"{name}={value!r}: must be an integer in [1, {MAX_HF_SIZE}]")
    for name in ("rms_norm_eps", "rope_theta"):
        value = getattr(cfg, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise UnsupportedModelError(f"{name}={value!r}: must be a finite number > 0")


def arch_from_hf(cfg: Any, dtype: str | None = None) -> ArchSpec:
    """Read an HF ``PretrainedConfig`` (llama / qwen2 / qwen3) into an :class:`ArchSpec`; its sizes are
    checked first (:func:`check_hf_sizes`). ``dtype``: the parameter dtype, already resolved
    (models/dtype.py; never ``"auto"``), else the config's own."""
    if dtype == AUTO_DTYPE:
        raise ValueError("arch_from_hf: resolve model.dtype='auto' first (models/dtype.resolve_model_dtype)")
    model_type = getattr(cfg, "model_type", None)
    if model_type not in ARCH_BY_MODEL_TYPE:
        archs = getattr(cfg, "architectures", None)
        raise UnsupportedModelError(
            f"model_type={model_type!r} (architectures={archs}) is not supported; supported: {sorted(ARCH_BY_MODEL_TYPE)}"
        )
    arch = ARCH_BY_MODEL_TYPE[model_type]
    attention = ATTENTION_OF.get(arch, arch)  # the dense family whose attention an MoE family uses
    if getattr(cfg, "mlp_bias", False):
        raise UnsupportedModelError(f"{model_type}: mlp_bias=True is not supported")
    if attention == "llama" and getattr(cfg, "attention_bias", False):
        raise UnsupportedModelError(f"{arch}: attention_bias=True (bias on o_proj too) is not supported")
    if attention == "qwen3" and getattr(cfg, "attention_bias", False):
        raise UnsupportedModelError(f"{arch}: attention_bias=True is not supported")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{model_type}: hidden_act={cfg.hidden_act!r} is not supported (SwiGLU needs 'silu')")
    if getattr(cfg, "use_sliding_window", False):
        raise UnsupportedModelError(f"{model_type}: use_sliding_window=True is not supported")
    check_hf_sizes(cfg)
    rope = _rope_params(cfg)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    torch_dtype = dtype or checkpoint_dtype(cfg) or FLOAT32
    moe = moe_fields_from_hf(cfg, arch, UnsupportedModelError) if arch in MOE_MODEL_TYPES else {}
    return ArchSpec(
        arch=arch,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        ffn_hidden_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.rms_norm_eps),
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=attention == "qwen2",
        qk_norm=attention == "qwen3",
        rope_scaling_factor=_llama3_factor(cfg, rope) if attention == "llama" else None,
        dtype=torch_dtype,
        hf_architecture=(getattr(cfg, "architectures", None) or [""])[0],
        **moe,
    )


def hf_config_from_model_config(model: Any, vocab_size: int | None = None) -> Any:
    """Our ``ModelConfig`` (arch + sizes) → the matching transformers config object, in the dtype a model
    built from sizes trains in (``auto``: float32, models/dtype.py)."""
    import transformers

    dtype = resolve_model_dtype(model.dtype, checkpoint=None)
    vocab = vocab_size if vocab_size is not None else model.vocab_size
    if vocab is None:
        raise ValueError("model.vocab_size is None and no tokenizer vocab_size was given")
    classes = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
    if model.arch not in classes and model.arch not in MOE_MODEL_TYPES:
        raise UnsupportedModelError(f"model.arch={model.arch!r} is not supported; supported: "
                                    f"{sorted([*classes, *MOE_MODEL_TYPES])}")
    kwargs: dict[str, Any] = dict(
        vocab_size=int(vocab),
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads,
        max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=model.rms_norm_eps,
        tie_word_embeddings=model.tie_embeddings,
        rope_theta=model.rope_theta,
        hidden_act="silu",
    )
    if model.arch in MOE_MODEL_TYPES:
        cfg = hf_moe_config(model, kwargs)
        cfg.dtype = dtype
        return cfg
    if model.arch == "qwen3":
        kwargs["head_dim"] = model.hidden_size // model.num_heads
    cfg = getattr(transformers, classes[model.arch])(**kwargs)
    cfg.architectures = [classes[model.arch].replace("Config", "ForCausalLM")]
    cfg.dtype = dtype
    return cfg


def arch_from_model_config(model: Any, vocab_size: int | None = None) -> ArchSpec:
    """Our ``ModelConfig`` → :class:`ArchSpec` (via the HF config, so both inputs share one path)."""
    return arch_from_hf(hf_config_from_model_config(model, vocab_size), dtype=resolve_model_dtype(model.dtype, None))


# --------------------------------------------------------------------------------------------
# layout checks and the Megatron model


def validate_layout(spec: ArchSpec, tp: int, pp: int, ep: int = 1, etp: int = 1) -> None:
    """Raise :class:`ParallelLayoutError` naming the rule when TP/PP (and EP/ETP) do not fit ``spec``.

    A pipeline split may be uneven (:func:`hacrl_megatron.config.layout.pipeline_layers`)."""
    if min(tp, pp, ep, etp) < 1:
        raise ParallelLayoutError(f"tp={tp}, pp={pp}, ep={ep}, etp={etp}: sizes must be >= 1")
    if spec.num_heads % tp:
        raise ParallelLayoutError(f"tp={tp} does not divide num_attention_heads={spec.num_heads} ({spec.arch})")
    if spec.num_kv_heads % tp:
        raise ParallelLayoutError(f"tp={tp} does not divide num_key_value_heads={spec.num_kv_heads} ({spec.arch})")
    if not spec.is_moe and spec.ffn_hidden_size % tp:
        raise ParallelLayoutError(f"tp={tp} does not divide intermediate_size={spec.ffn_hidden_size}")
    try:
        pipeline_layers(spec.num_layers, pp)
    except LayoutError as err:
        raise ParallelLayoutError(f"{err} (num_hidden_layers of {spec.arch})") from None
    if not spec.is_moe:
        if (ep, etp) != (1, 1):
            raise ParallelLayoutError(f"ep={ep}, etp={etp}: expert parallelism needs an MoE model, {spec.arch} is dense")
        return
    if spec.num_experts % ep:
        raise ParallelLayoutError(f"ep={ep} does not divide num_experts={spec.num_experts} ({spec.arch})")
    if ep == 1 and etp != tp:  # megatron-core reduces non-expert-parallel experts with the dense parameters
        raise ParallelLayoutError(f"ep=1 needs etp = tp = {tp} (got etp={etp}): without expert parallelism the experts "
                                  "are split like attention")
    if spec.moe_ffn_hidden_size % etp:
        raise ParallelLayoutError(f"etp={etp} does not divide the expert FFN width {spec.moe_ffn_hidden_size}")
    if spec.shared_expert_ffn_hidden_size % tp:
        raise ParallelLayoutError(f"tp={tp} does not divide shared_expert_intermediate_size="
                                  f"{spec.shared_expert_ffn_hidden_size}")


def use_transformer_engine() -> bool:
    """TE layer spec only with CUDA and an importable transformer_engine (never on CPU)."""
    return transformer_engine_available()


def recompute_kwargs(recompute: str) -> dict[str, Any]:
    """``TransformerConfig`` fields of an activation-recompute mode (Korthikanti et al. 2022).

    ``none``: keep every activation; ``selective``: recompute the attention core (softmax,
    dropout, scores: the ``5as/h`` term of the paper's Table 2); ``full``: keep only each
    layer's input and recompute the layer in backward (``uniform``, one layer per checkpoint).
    """
    if recompute not in RECOMPUTE:
        raise ParallelLayoutError(f"recompute={recompute!r}: must be one of {list(RECOMPUTE)}")
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


def moe_grouped_gemm(spec: ArchSpec, te: bool) -> bool:
    """Whether an MoE model's experts run as one grouped GEMM: exactly when the layers come from
    Transformer Engine's spec (``TEGroupedMLP``); the local spec loops over ``SequentialMLP`` experts.
    The one value that both :func:`layer_spec` and ``TransformerConfig.moe_grouped_gemm`` use."""
    return bool(spec.num_experts) and bool(te)


def transformer_config(spec: ArchSpec, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                       recompute: str = "none", ep: int = 1, etp: int = 1, moe: MoESettings | None = None,
                       grouped_gemm: bool | None = None, cp: int = 1) -> Any:
    """megatron-core ``TransformerConfig`` for ``spec`` at tensor/pipeline sizes ``tp``/``pp`` (and the
    expert layout ``ep``/``etp`` with the training-side ``moe`` settings for MoE models).
    ``cp``: context-parallel size, attention by Transformer Engine's ring exchange of keys and values
    (``cp_comm_type="p2p"``: every rank keeps all heads, no head-count rule beyond tp's).
    ``grouped_gemm``: :func:`moe_grouped_gemm` of the layer spec the model is built with (default:
    the spec :func:`layer_spec` picks here)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    validate_layout(spec, tp, pp, ep, etp)
    if spec.is_moe and tp > 1 and not sequence_parallel:
        raise ParallelLayoutError(f"tp={tp} with MoE layers needs sequence_parallel=True (megatron-core routes each "
                                  "rank's slice of the sequence)")
    dtype = DTYPES[spec.dtype]
    first, last = uneven_stage_sizes(spec.num_layers, pp)
    if grouped_gemm is None:
        grouped_gemm = moe_grouped_gemm(spec, use_transformer_engine())
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.moe_ffn_hidden_size if spec.is_moe else spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        # the fusions are CUDA kernels or torch.compile'd; they change nothing numerically that we need
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        calculate_per_token_loss=True,  # sum micro-batch losses, no DP averaging (agents/local.py)
        variable_seq_lengths=True,  # PP: micro-batches are padded per batch, not to a fixed length
        moe_token_dispatcher_type="alltoall",  # mcore's check for variable_seq_lengths (also for dense models)
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        context_parallel_size=cp,
        cp_comm_type="p2p" if cp > 1 else None,
        **recompute_kwargs(recompute),
        **moe_transformer_kwargs(spec, ep, etp, moe, grouped_gemm),
    )


def layer_spec(spec: ArchSpec, te: bool | None = None, stage_layers: int | None = None) -> Any:
    """Transformer-Engine spec when available (GPU; MoE experts as TE's grouped GEMM), else the local
    spec (CPU; ``SequentialMLP`` experts), as a block of ``stage_layers`` layers with the
    sequence-parallel-capable RMSNorm (:mod:`hacrl_megatron.models.local_spec`)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from hacrl_megatron.models.local_spec import local_block_spec

    experts = spec.num_experts or None
    use_te = te if te is not None else use_transformer_engine()
    grouped = moe_grouped_gemm(spec, use_te)  # the value transformer_config must get too
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=grouped, qk_layernorm=spec.qk_norm)
    layer = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=grouped,
                                                     qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    return layer if stage_layers is None else local_block_spec(layer, stage_layers)


def build_gpt_model(
    spec: ArchSpec,
    tp: int = 1,
    pp: int = 1,
    *,
    ep: int = 1,
    etp: int = 1,
    sequence_parallel: bool = False,
    vocab_divisible_by: int = 1,
    te: bool | None = None,
    recompute: str = "none",
    init_weights: bool = True,
    moe: MoESettings | None = None,
    meta_rank: tuple[int, int] | None = None,
    meta_dp: int | None = None,
    cp: int = 1,
) -> Any:
    """The ``GPTModel`` of this rank's pipeline stage (needs :func:`init_parallel` first).

    Output: the model returns vocab-parallel logits ``[B, T, V_padded / tp]`` on the last stage and
    hidden states ``[T, B, H]`` on the others (megatron-core convention).

    ``init_weights=False`` skips megatron's random initialisation, for callers that load every
    parameter next (conversion): on CPU it would first build each weight at full, unsharded size in
    fp32 (``_initialize_affine_weight_cpu``), the peak of a 70B conversion.

    ``cp``: context-parallel size (the parallel state's, :func:`~hacrl_megatron.models.parallel.init_parallel`);
    > 1 needs the Transformer Engine layer spec (raises :class:`ParallelLayoutError` otherwise). The model
    then takes this rank's chunks of each row (agents/context_parallel.py) and megatron's RoPE gives them
    their global positions.

    ``meta_rank=(tp_rank, pp_rank)`` builds that rank of a ``tp`` × ``pp`` (× ``ep`` × ``etp``) layout on
    the ``meta`` device instead: no world, no :func:`init_parallel`, no parameter memory (shapes only;
    ~0.05 s for one TP8 × PP8 rank of a 70B model). The model gets stand-in process groups
    (:func:`hacrl_megatron.models.meta.stand_in_groups`; ``meta_dp`` is the data-parallel size, by
    default the smallest that holds ``ep·etp``) through megatron-core's ``pg_collection``, so every
    layer is sized exactly as on the real rank; used by the planner to count each rank's parameters
    and by tests of 70B+ layouts. Always the local layer spec (TE's fused norms hold the same
    parameters under other names).
    """
    from megatron.core.models.gpt import GPTModel

    from hacrl_megatron.models import meta

    use_te = (te if te is not None else use_transformer_engine()) and meta_rank is None
    if cp > 1 and not use_te:  # megatron's local DotProductAttention asserts cp == 1
        raise ParallelLayoutError(f"cp={cp}: context parallelism needs Transformer Engine's layer spec (CUDA)")
    config = transformer_config(spec, tp, pp, sequence_parallel, recompute, ep, etp, moe,
                                grouped_gemm=moe_grouped_gemm(spec, use_te), cp=cp)  # as layer_spec below
    config.perform_initialization = init_weights
    kwargs: dict[str, Any] = {}
    if spec.rope_scaling_factor is not None:
        kwargs.update(rope_scaling=True, rope_scaling_factor=spec.rope_scaling_factor)
    if meta_rank is None:
        from megatron.core import parallel_state as mpu

        first, last, context = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage(), contextlib.nullcontext()
        pp_rank = mpu.get_pipeline_model_parallel_rank()
    else:
        tp_rank, pp_rank = _check_meta_rank(meta_rank, tp, pp)
        first, last = pp_rank == 0, pp_rank == pp - 1
        config.perform_initialization = False  # nothing to initialise on meta
        config.use_cpu_initialization = True  # no torch.cuda.current_device() placement
        kwargs["pg_collection"] = meta.stand_in_groups(tp, pp, tp_rank, pp_rank, ep, etp, meta_dp)
        context = meta.meta_build_context()
    block = layer_spec(spec, use_te, None if use_te else pipeline_layers(spec.num_layers, pp)[pp_rank])
    with context:
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=spec.padded_vocab_size(tp, vocab_divisible_by),
            max_sequence_length=spec.max_position_embeddings,
            pre_process=first,
            post_process=last,
            share_embeddings_and_output_weights=spec.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
            parallel_output=True,
            **kwargs,
        )
    if torch.cuda.is_available() and meta_rank is None:
        model.cuda(torch.cuda.current_device())
    return model


def _check_meta_rank(meta_rank: tuple[int, int], tp: int, pp: int) -> tuple[int, int]:
    tp_rank, pp_rank = (int(r) for r in meta_rank)
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise ParallelLayoutError(f"meta_rank=(tp_rank={tp_rank}, pp_rank={pp_rank}) is outside tp={tp}, pp={pp}")
    return tp_rank, pp_rank
