"""Mixture-of-Experts families: reading their HF configs and the megatron-core MoE settings.

Families (every decoder layer is an MoE layer; docs/moe.md):

* ``qwen3_moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (QK-norm, explicit head_dim),
  softmax router, top-k, optional renormalisation of the top-k probabilities (``norm_topk_prob``);
* ``mixtral`` (Mixtral-8x7B): Llama attention, softmax router, top-k always renormalised;
* ``qwen2_moe`` (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (QKV bias), softmax router, plus a
  shared expert whose output is scaled by ``sigmoid(x · w_gate)``.

Router mapping: HF takes softmax over all experts, then the top k, then (when renormalising)
divides by their sum. megatron-core's ``moe_router_pre_softmax=True`` is softmax-then-top-k
(no renormalisation); ``False`` takes the top k logits and a softmax over those k, which equals the
renormalised probabilities. So ``moe_router_pre_softmax = not norm_topk_prob``.

Dispatcher: all-to-all (set for every model by the provider): megatron-core's allgather dispatcher
refuses ``variable_seq_lengths`` (our padded micro-batches) and the flex dispatcher needs DeepEP (GPU).

RL settings (:class:`MoESettings`): capacity factor off, no token dropping (training must route
every token as inference does, or π_θ/π_old compares different functions); the router in float32;
the load-balancing and z-loss coefficients rescaled per update by the agent for our summed loss
(agents/local.py); routing replay optional.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = {"qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "qwen2_moe": "qwen2_moe"}
_HF_CONFIG_CLASSES = {"qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig"}
ATTENTION_OF = {"qwen3_moe": "qwen3", "mixtral": "llama", "qwen2_moe": "qwen2"}  # the dense family's attention


@dataclass(frozen=True)
class MoESettings:
    """Training-side MoE settings of one agent (not part of the architecture, so not in ArchSpec).

    aux_loss_coeff: load-balancing loss coefficient (Switch Transformer, Fedus et al. 2021, eq. 4).
    z_loss_coeff: router z-loss coefficient (ST-MoE, Zoph et al. 2022, eq. 5).
    routing_replay: build megatron-core's ``RouterReplay`` hooks (record / replay top-k choices).
    """

    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    routing_replay: bool = False

    @classmethod
    def from_model_config(cls, model: Any) -> MoESettings:
        return cls(float(getattr(model, "moe_aux_loss_coeff", 0.0)), float(getattr(model, "moe_z_loss_coeff", 0.0)),
                   bool(getattr(model, "moe_routing_replay", False)))


def moe_fields_from_hf(cfg: Any, arch: str, unsupported: type[Exception]) -> dict[str, Any]:
    """ArchSpec's MoE fields from an HF MoE config (raises ``unsupported`` naming the feature)."""
    if arch == "mixtral":
        if getattr(cfg, "sliding_window", None) not in (None, 0):
            raise unsupported(f"mixtral: sliding_window={cfg.sliding_window} is not supported")
        if float(getattr(cfg, "router_jitter_noise", 0.0) or 0.0) != 0.0:
            raise unsupported(f"mixtral: router_jitter_noise={cfg.router_jitter_noise} is not supported")
        experts, width, norm, shared = cfg.num_local_experts, cfg.intermediate_size, True, 0
    else:
        if int(getattr(cfg, "decoder_sparse_step", 1) or 1) != 1 or list(getattr(cfg, "mlp_only_layers", None) or []):
            raise unsupported(f"{arch}: dense layers between MoE layers (decoder_sparse_step="
                              f"{getattr(cfg, 'decoder_sparse_step', 1)}, mlp_only_layers={cfg.mlp_only_layers}) "
                              "are not supported: every layer must be an MoE layer")
        experts, width = cfg.num_experts, cfg.moe_intermediate_size
        norm = bool(getattr(cfg, "norm_topk_prob", False))
        shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0) if arch == "qwen2_moe" else 0
        if arch == "qwen2_moe" and shared < 1:
            raise unsupported("qwen2_moe: shared_expert_intermediate_size must be >= 1 (the shared expert)")
    topk = int(cfg.num_experts_per_tok)
    if not 1 <= topk <= experts:
        raise unsupported(f"{arch}: num_experts_per_tok={topk} must lie in [1, {experts}]")
    return dict(num_experts=int(experts), moe_topk=topk, moe_ffn_hidden_size=int(width),
                shared_expert_ffn_hidden_size=shared, norm_topk_prob=norm)


def hf_moe_config(model: Any, kwargs: dict[str, Any]) -> Any:
    """The transformers config of an MoE ``ModelConfig`` (``kwargs``: the fields shared with dense)."""
    import transformers

    width = model.moe_ffn_hidden_size or model.ffn_hidden_size
    kw = dict(kwargs, num_experts_per_tok=model.moe_topk, output_router_logits=False)
    if model.arch == "mixtral":
        kw.update(num_local_experts=model.num_experts, intermediate_size=width, sliding_window=None,
                  router_jitter_noise=0.0)
    else:
        kw.update(num_experts=model.num_experts, moe_intermediate_size=width, norm_topk_prob=model.norm_topk_prob,
                  decoder_sparse_step=1, mlp_only_layers=[])
    if model.arch == "qwen3_moe":
        kw["head_dim"] = model.hidden_size // model.num_heads
    if model.arch == "qwen2_moe":
        kw.update(shared_expert_intermediate_size=model.shared_expert_ffn_hidden_size, use_sliding_window=False)
    cls = _HF_CONFIG_CLASSES[model.arch]
    cfg = getattr(transformers, cls)(**kw)
    cfg.architectures = [cls.replace("Config", "ForCausalLM")]
    return cfg


def moe_transformer_kwargs(spec: Any, ep: int, etp: int, settings: MoESettings | None,
                           grouped_gemm: bool = False) -> dict[str, Any]:
    """``TransformerConfig`` fields of an MoE ``spec`` at expert layout ``ep`` × ``etp`` ({} for dense).

    ``grouped_gemm``: the experts run as one grouped GEMM, the same value the layer spec was built
    with (``provider.moe_grouped_gemm``: Transformer Engine's ``TEGroupedMLP``)."""
    if not spec.num_experts:
        return {}
    s = settings or MoESettings()
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=s.aux_loss_coeff,
        moe_z_loss_coeff=s.z_loss_coeff or None,  # None skips the z-loss computation altogether
        moe_expert_capacity_factor=None,  # no capacity, no token dropping: route like inference
        moe_grouped_gemm=grouped_gemm,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=bool(spec.shared_expert_ffn_hidden_size),
        moe_shared_expert_overlap=False,
        moe_enable_routing_replay=s.routing_replay,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
