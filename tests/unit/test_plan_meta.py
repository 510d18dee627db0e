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
