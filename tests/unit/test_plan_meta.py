"""Meta-device builds of 70B+ layouts (no memory, no world) against the planner's analytic counts.

The HF configurations are those published with each model (written here, nothing downloads).
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from hacrl_megatron.models.provider import ParallelLayoutError, build_gpt_model  # noqa: E402
from hacrl_megatron.plan.params import arch_from_config, rank_params, stage_params  # noqa: E402

LLAMA_31_70B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}
LLAMA_31_405B = {**LLAMA_31_70B, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                 "num_attention_heads": 128}
QWEN25_72B = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 8192, "intermediate_size": 29568,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "use_sliding_window": False, "torch_dtype": "bfloat16",
}
QWEN3_32B = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 5120, "intermediate_size": 25600,
    "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
}
# the parameter counts each model card / safetensors index reports (total_size / 2 bytes)
HF_TOTALS = {"llama70b": 70_553_706_496, "qwen72b": 72_706_203_648, "llama405b": 405_853_388_800,
             "qwen32b": 32_762_123_264}
CONFIGS = {"llama70b": LLAMA_31_70B, "qwen72b": QWEN25_72B, "llama405b": LLAMA_31_405B, "qwen32b": QWEN3_32B}
LAYOUTS = {
    "llama70b": [(8, 8), (4, 4), (8, 1), (2, 5)],
    "qwen72b": [(8, 8), (4, 2), (8, 5)],
    "llama405b": [(8, 9), (8, 14), (4, 7)],
    "qwen32b": [(8, 4), (4, 2), (2, 8)],
}


def meta_counts(spec, tp: int, pp: int, tp_rank: int = 0) -> list[int]:
    """Parameters of one TP rank of every stage, each stage built on meta (one rank per stage)."""
    counts = []
    for stage in range(pp):
        model = build_gpt_model(spec, tp, pp, meta_rank=(tp_rank, stage))
        assert {p.device.type for p in model.parameters()} == {"meta"}
        counts.append(sum(p.numel() for p in model.parameters()))
    return counts


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_parameter_count_matches_published(name):
    assert arch_from_config(CONFIGS[name]).num_parameters() == HF_TOTALS[name]


def test_llama70b_tp8_pp8_reference_counts():
    """Counts measured on megatron-core 0.16.1 with a real TP8 × PP8 world (issue reference)."""
    spec = arch_from_config(LLAMA_31_70B)
    counts = meta_counts(spec, 8, 8, tp_rank=3)
    assert counts[0] == 1_201_045_504
    assert counts[1:7] == [1_069_711_360] * 6
    assert counts[7] == 1_201_053_696
    assert counts == list(stage_params(spec, 8, 8))


@pytest.mark.parametrize("name,tp,pp", [(n, tp, pp) for n in sorted(LAYOUTS) for tp, pp in LAYOUTS[n]])
def test_meta_counts_equal_analytic_and_sum_to_hf(name, tp, pp):
    spec = arch_from_config(CONFIGS[name])
    counts = meta_counts(spec, tp, pp)
    assert counts == list(stage_params(spec, tp, pp))
    rp = rank_params(spec, tp, pp)
    assert rp.all_ranks == tp * sum(counts)
    # every rank's sum is the HF count plus TP copies of the norms and the vocabulary padding
    assert rp.all_ranks == HF_TOTALS[name] + rp.tp_replicated_extra + rp.vocab_padding_extra + rp.tied_copy_extra
    h, layers = spec.hidden_size, spec.num_layers
    norms = 2 * h + (2 * spec.head_dim if spec.qk_norm else 0)
    assert rp.tp_replicated_extra == (tp - 1) * (norms * layers + h)


def test_tied_small_model_pipeline_copy_counted():
    """A tied model split over stages keeps a copy of the embedding on the last stage."""
    cfg = {**QWEN3_32B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1001, "tie_word_embeddings": True}
    spec = arch_from_config(cfg)
    for tp, pp in [(1, 1), (2, 1), (2, 2)]:
        assert meta_counts(spec, tp, pp) == list(stage_params(spec, tp, pp))
        rp = rank_params(spec, tp, pp)
        assert rp.all_ranks == rp.hf_total + rp.tp_replicated_extra + rp.vocab_padding_extra + rp.tied_copy_extra
    assert rank_params(spec, 2, 2).tied_copy_extra == 1002 * 256  # V padded to a multiple of tp=2


def test_meta_build_leaves_no_world_behind():
    import torch.distributed as dist
    from megatron.core import parallel_state

    # Other tests in this process may hold a world of their own: the build must leave whatever is there as it was.
    before = (dist.is_initialized(), parallel_state.model_parallel_is_initialized())
    spec = arch_from_config(QWEN3_32B)
    build_gpt_model(spec, 8, 4, meta_rank=(7, 3))
    assert (dist.is_initialized(), parallel_state.model_parallel_is_initialized()) == before


def test_meta_rank_outside_layout_raises():
    spec = arch_from_config(QWEN3_32B)
    with pytest.raises(ParallelLayoutError, match="outside tp=8, pp=4"):
        build_gpt_model(spec, 8, 4, meta_rank=(8, 0))
    with pytest.raises(ParallelLayoutError, match="pp=63 cannot split num_layers=64"):
        build_gpt_model(spec, 8, 63, meta_rank=(0, 0))


# --------------------------------------------------------------------------------------------
# Mixture of Experts: attention and router replicated over TP, experts split over EP × ETP

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "attention_bias": False, "torch_dtype": "bfloat16",
}
QWEN3_235B_A22B = {**QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                   "num_hidden_layers": 94, "num_attention_heads": 64}


def moe_meta_counts(spec, tp: int, pp: int, ep: int, etp: int = 1, tp_rank: int = 0) -> list[int]:
    counts = []
    for stage in range(pp):
        model = build_gpt_model(spec, tp, pp, ep=ep, etp=etp, sequence_parallel=tp > 1, meta_rank=(tp_rank, stage))
        assert {p.device.type for p in model.parameters()} == {"meta"}
        counts.append(sum(p.numel() for p in model.parameters()))
    return counts


def test_moe_parameter_totals():
    """HF counts (total, and active: one token's top-k experts) of the published configurations."""
    q30, q235 = arch_from_config(QWEN3_30B_A3B), arch_from_config(QWEN3_235B_A22B)
    assert (q30.num_parameters(), q30.active_parameters()) == (30_532_122_624, 3_353_032_704)
    assert (q235.num_parameters(), q235.active_parameters()) == (235_093_634_560, 22_190_763_520)


@pytest.mark.parametrize("name,tp,pp,ep,expected", [
    ("30b", 4, 4, 8, [1_043_581_952, 965_790_720, 965_790_720, 1_043_584_000]),
    ("235b", 4, 2, 8, [15_211_958_016, 15_211_962_112]),
    ("235b", 4, 4, 8, [7_523_596_032, 7_688_361_984, 7_688_361_984, 7_523_600_128]),  # 94 layers: 23/24/24/23
])
def test_moe_meta_counts_equal_analytic(name, tp, pp, ep, expected):
    spec = arch_from_config({"30b": QWEN3_30B_A3B, "235b": QWEN3_235B_A22B}[name])
    counts = moe_meta_counts(spec, tp, pp, ep, tp_rank=1)
    assert counts == expected == list(stage_params(spec, tp, pp, ep=ep))
    rp = rank_params(spec, tp, pp, ep=ep)
    assert rp.all_ranks == rp.hf_total + rp.tp_replicated_extra + rp.vocab_padding_extra + rp.tied_copy_extra
    h, d, e = spec.hidden_size, spec.head_dim, spec.num_experts
    assert rp.tp_replicated_extra == (tp - 1) * ((2 * h + 2 * d + e * h) * spec.num_layers + h)  # norms, router


def test_moe_meta_counts_with_expert_tensor_parallel_and_shared_expert():
    """A qwen2_moe-shaped model (shared expert, QKV bias) with experts split over ETP too."""
    cfg = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 256,
           "intermediate_size": 512, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 384,
           "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 4, "num_experts": 8,
           "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "vocab_size": 1001, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "tie_word_embeddings": False, "hidden_act": "silu", "use_sliding_window": False}
    spec = arch_from_config(cfg)
    for tp, pp, ep, etp in [(1, 1, 1, 1), (2, 2, 2, 2), (2, 3, 4, 1), (4, 2, 2, 2)]:
        assert moe_meta_counts(spec, tp, pp, ep, etp) == list(stage_params(spec, tp, pp, ep=ep, etp=etp)), (tp, pp, ep)
        rp = rank_params(spec, tp, pp, ep=ep, etp=etp)
        assert rp.all_ranks == rp.hf_total + rp.tp_replicated_extra + rp.vocab_padding_extra + rp.tied_copy_extra
