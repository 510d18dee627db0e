"""Tiny random HF MoE models of the three families (hidden 32, 2 layers, 4 experts, top-2, vocab 97).

Saved with ``save_pretrained`` (per-expert names on disk) so the tests read the safetensors layout;
``in_memory_state`` is what transformers ≥ 5 holds (fused 3-D expert tensors). Norm weights are
perturbed so that every tensor matters; the router is scaled up so the top-k choice is well separated
(no near-ties that would make the experts chosen by HF and by megatron differ on rounding).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from tests.distributed.megatron_helpers import VOCAB

MOE_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")


def tiny_moe_config(arch: str, vocab: int = VOCAB, layers: int = 2, norm_topk_prob: bool = True,
                    experts: int = 4, tie: bool | None = None) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=5000.0, num_experts_per_tok=2,
        tie_word_embeddings=(arch != "qwen2_moe") if tie is None else tie, output_router_logits=False,
    )
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, num_experts=experts, moe_intermediate_size=16, intermediate_size=64,
                                          head_dim=8, norm_topk_prob=norm_topk_prob)
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_local_experts=experts, intermediate_size=16)
    else:
        cfg = transformers.Qwen2MoeConfig(**common, num_experts=experts, moe_intermediate_size=16, intermediate_size=64,
                                          shared_expert_intermediate_size=24, norm_topk_prob=norm_topk_prob)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return cfg


def make_tiny_moe(arch: str, out_dir: str | None, seed: int = 0, **cfg_kw: Any) -> Any:
    """A random tiny HF MoE model (saved to ``out_dir`` when given), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(arch, **cfg_kw), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif "experts" in name:
                p.normal_(0.0, 0.1)
    if out_dir is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(out_dir)
    return model.eval()


def in_memory_state(model: Any) -> dict[str, torch.Tensor]:
    """The HF model's own state dict (fused experts), the tied LM head dropped as an export does."""
    tied = model.config.tie_word_embeddings
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


def disk_state(out_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a saved HF folder (per-expert names)."""
    from safetensors.torch import load_file

    return load_file(f"{out_dir}/model.safetensors")
