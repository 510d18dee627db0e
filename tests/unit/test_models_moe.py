"""MoE models in one process: HF configs → ArchSpec, exact logits against transformers for the three
MoE families, conversion both ways (fused 3-D expert tensors in memory, per-expert names on disk),
the layout rules, and init_parallel's expert sizes."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from hacrl_megatron.models.parallel import ParallelStateError, init_parallel  # noqa: E402


def test_init_parallel_refuses_an_expert_layout_that_does_not_fit():
    with pytest.raises(ParallelStateError, match="ep·etp = 2·1 must divide tp·dp = 1·1"):
        init_parallel(1, 1, 1, ep=2)
    info = init_parallel(1, 1, 1)
    assert (info.ep, info.etp, info.ep_rank) == (1, 1, 0)


# --------------------------------------------------------------------------------------------
# HF configs, logits, conversion (one process, TP = PP = EP = 1)

import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from hacrl_megatron.models import convert, export  # noqa: E402
from hacrl_megatron.models.convert_moe import fuse_experts  # noqa: E402
from hacrl_megatron.models.provider import (  # noqa: E402
    ParallelLayoutError,
    UnsupportedModelError,
    arch_from_hf,
    build_gpt_model,
    validate_layout,
)
from tests.distributed.moe_helpers import (  # noqa: E402
    disk_state,
    in_memory_state,
    make_tiny_moe,
    tiny_moe_config,
)

IDS = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(5))


def _megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        model.eval()
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)[..., :97]


@pytest.mark.parametrize("arch,norm", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True),
                                       ("qwen2_moe", False), ("qwen2_moe", True)])
def test_logits_equal_hf_from_disk_and_from_memory(tmp_path, arch, norm):
    """Loaded from the saved folder (per-expert names) and from the in-memory state dict (fused 3-D
    experts), the Megatron model's logits equal transformers'; the export is the saved folder, bit for bit."""
    hf = make_tiny_moe(arch, str(tmp_path), seed=3, norm_topk_prob=norm)
    spec = arch_from_hf(hf.config)
    assert spec.norm_topk_prob is (True if arch == "mixtral" else norm)
    assert spec.num_parameters() == sum(p.numel() for p in hf.parameters())
    init_parallel(1, 1, 1)
    with torch.no_grad():
        ref = hf(IDS).logits
    for source in (str(tmp_path), in_memory_state(hf)):
        model = build_gpt_model(spec)
        convert.load_hf_weights(model, spec, source)
        err = float((_megatron_logits(model, IDS) - ref).abs().max())
        assert err <= 1e-5 * float(ref.abs().max()), (arch, norm, err)
    exported = dict(export.export_hf_weights(model, spec))
    saved = disk_state(str(tmp_path))
    saved.pop("lm_head.weight", None) if spec.tie_embeddings else None
    assert set(exported) == set(saved) and all(torch.equal(exported[k], saved[k]) for k in saved)
    fused = dict(fuse_experts(iter(exported.items()), spec))
    memory = in_memory_state(hf)
    assert set(fused) == set(memory) and all(torch.equal(fused[k], memory[k]) for k in memory)


def test_moe_config_round_trip_and_counts():
    from hacrl_megatron.config import ModelConfig
    from hacrl_megatron.models.provider import arch_from_model_config, hf_config_from_model_config

    m = ModelConfig(arch="qwen2_moe", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                    vocab_size=97, num_experts=4, moe_topk=2, moe_ffn_hidden_size=16, shared_expert_ffn_hidden_size=24,
                    norm_topk_prob=False)
    spec = arch_from_model_config(m)
    assert (spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size, spec.shared_expert_ffn_hidden_size) == (4, 2, 16, 24)
    assert spec.qkv_bias and not spec.qk_norm and not spec.norm_topk_prob
    hf = transformers.AutoModelForCausalLM.from_config(hf_config_from_model_config(m))
    assert spec.num_parameters() == sum(p.numel() for p in hf.parameters())
    h = 32
    assert spec.active_parameters() == spec.num_parameters() - 2 * (4 - 2) * 3 * h * 16


def test_unsupported_moe_features_are_named():
    cfg = tiny_moe_config("qwen3_moe")
    cfg.decoder_sparse_step = 2
    with pytest.raises(UnsupportedModelError, match="every layer must be an MoE layer"):
        arch_from_hf(cfg)
    cfg = tiny_moe_config("mixtral")
    cfg.sliding_window = 16
    with pytest.raises(UnsupportedModelError, match="mixtral: sliding_window=16"):
        arch_from_hf(cfg)


def test_moe_layout_rules():
    spec = arch_from_hf(tiny_moe_config("qwen3_moe"))  # 4 experts, expert FFN 16
    validate_layout(spec, 2, 1, ep=4, etp=2)
    with pytest.raises(ParallelLayoutError, match="ep=3 does not divide num_experts=4"):
        validate_layout(spec, 1, 1, ep=3)
    with pytest.raises(ParallelLayoutError, match="etp=3 does not divide the expert FFN width 16"):
        validate_layout(spec, 1, 1, ep=2, etp=3)
    with pytest.raises(ParallelLayoutError, match="ep=1 needs etp = tp = 2"):
        validate_layout(spec, 2, 1, ep=1, etp=1)
    init_parallel(1, 1, 1)
    with pytest.raises(ParallelLayoutError, match="needs sequence_parallel=True"):
        build_gpt_model(spec, 2, 1, etp=2, meta_rank=(0, 0))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_export_copied_into_a_transformers_model_by_name(tmp_path, arch):
    """An export (per-expert names) reaches a transformers ≥ 5 model (fused experts) through
    ``module_layout``: copied by parameter name, the model then computes the exporter's logits."""
    from hacrl_megatron.models.convert_moe import module_layout

    source = make_tiny_moe(arch, None, seed=8)
    target = make_tiny_moe(arch, None, seed=9)
    spec = arch_from_hf(source.config)
    init_parallel(1, 1, 1)
    model = build_gpt_model(spec)
    convert.load_hf_weights(model, spec, in_memory_state(source))
    params = dict(target.named_parameters())
    with torch.no_grad():
        for name, tensor in module_layout(export.export_hf_weights(model, spec), target, spec):
            params[name].copy_(tensor)
        assert torch.equal(target(IDS).logits, source(IDS).logits)


def test_transformer_engine_expert_names_map_like_the_local_ones():
    """TE's grouped-GEMM experts (``mlp.experts.linear_fc1.weight{j}``, the GPU spec) and the local
    ``SequentialMLP`` names give the same HF tensors; the export lists every expert of every EP rank."""
    from hacrl_megatron.models.convert_moe import expand_expert_suffixes

    spec = arch_from_hf(tiny_moe_config("mixtral"))  # 4 experts
    te = convert.plan_for(spec, "decoder.layers.1.mlp.experts.linear_fc1.weight1", 3, expert_offset=2)
    local = convert.plan_for(spec, "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight", 3, expert_offset=2)
    assert te == local and te.split == "etp" and te.kind == "fc1"
    assert te.hf_names == ("model.layers.4.block_sparse_moe.experts.3.w1.weight",
                           "model.layers.4.block_sparse_moe.experts.3.w3.weight")
    router = convert.plan_for(spec, "decoder.layers.0.mlp.router.weight", 0)
    assert router.hf_names == ("model.layers.0.block_sparse_moe.gate.weight",) and router.split == "tp"
    suffixes = ["input_layernorm.weight", "mlp.experts.linear_fc1.weight0", "mlp.experts.linear_fc2.weight0",
                "mlp.experts.linear_fc1.weight1", "mlp.experts.linear_fc2.weight1", "mlp.router.weight"]
    order = expand_expert_suffixes(spec, suffixes, ep=2)  # this rank holds 2 of the 4 experts
    assert [e for _, e in order] == [None, 0, 0, 1, 1, 2, 2, 3, 3, None]
