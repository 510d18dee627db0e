"""HF config → ArchSpec → megatron TransformerConfig, layout validation and the parallel-state helper."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from hacrl_megatron.config import ModelConfig  # noqa: E402
from hacrl_megatron.models.parallel import ParallelStateError, init_parallel, shutdown_parallel  # noqa: E402
from hacrl_megatron.models.provider import (  # noqa: E402
    ParallelLayoutError,
    UnsupportedModelError,
    arch_from_hf,
    arch_from_model_config,
    build_gpt_model,
    hf_config_from_model_config,
    transformer_config,
    validate_layout,
)
from tests.distributed.megatron_helpers import ARCHS, tiny_hf_config  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def test_family_features():
    llama, qwen2, qwen3 = (arch_from_hf(tiny_hf_config(a)) for a in ARCHS)
    assert (llama.qkv_bias, llama.qk_norm, llama.tie_embeddings) == (False, False, True)
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.tie_embeddings) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 8)
    assert llama.rope_theta == 5000.0 and llama.rms_norm_eps == 1e-6 and llama.num_kv_heads == 2


def test_qwen3_explicit_head_dim_differs_from_hidden_over_heads():
    cfg = tiny_hf_config("qwen3")
    cfg.head_dim = 16  # Qwen3 checkpoints set head_dim independently of hidden/heads
    spec = arch_from_hf(cfg)
    tc = transformer_config(spec)
    assert spec.head_dim == 16 and tc.kv_channels == 16 and tc.qk_layernorm and tc.num_query_groups == 2


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tie", [True, False])
def test_num_parameters_matches_hf(arch, tie):
    cfg = tiny_hf_config(arch, tie=tie)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    assert arch_from_hf(cfg).num_parameters() == sum(p.numel() for p in hf.parameters())


def test_model_config_goes_through_the_hf_config():
    mc = ModelConfig(arch="qwen3", hidden_size=48, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                     tie_embeddings=False, rope_theta=1e5, rms_norm_eps=1e-5)
    spec = arch_from_model_config(mc, vocab_size=200)
    cfg = hf_config_from_model_config(mc, vocab_size=200)
    assert spec == arch_from_hf(cfg)
    assert isinstance(cfg, transformers.Qwen3Config) and cfg.architectures == ["Qwen3ForCausalLM"]
    assert (spec.vocab_size, spec.head_dim, spec.rope_theta, spec.tie_embeddings) == (200, 12, 1e5, False)
    with pytest.raises(ValueError, match="vocab_size"):
        arch_from_model_config(ModelConfig(), vocab_size=None)


def test_unsupported_architectures_are_named():
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'"):
        arch_from_hf(transformers.GPT2Config())
    with pytest.raises(UnsupportedModelError, match="model.arch='mistral'"):
        hf_config_from_model_config(ModelConfig(arch="mistral"), 10)
    cfg = tiny_hf_config("llama")
    cfg.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(UnsupportedModelError, match="rope_type='yarn'"):
        arch_from_hf(cfg)
    cfg = tiny_hf_config("llama")
    cfg.attention_bias = True
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        arch_from_hf(cfg)


def test_llama3_rope_scaling_is_mapped():
    cfg = tiny_hf_config("llama")
    cfg.rope_parameters = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192, "rope_theta": 5e5}
    spec = arch_from_hf(cfg)
    assert spec.rope_scaling_factor == 32.0 and spec.rope_theta == 5e5
    cfg.rope_parameters["high_freq_factor"] = 2.0
    with pytest.raises(UnsupportedModelError, match="high_freq_factor"):
        arch_from_hf(cfg)


def test_layout_errors_name_the_rule():
    spec = arch_from_hf(tiny_hf_config("llama"))  # 4 heads, 2 KV heads, 2 layers, ffn 64
    with pytest.raises(ParallelLayoutError, match="tp=3 does not divide num_attention_heads=4"):
        validate_layout(spec, 3, 1)
    with pytest.raises(ParallelLayoutError, match="tp=4 does not divide num_key_value_heads=2"):
        validate_layout(spec, 4, 1)
    with pytest.raises(ParallelLayoutError, match="pp=3 cannot split num_layers=2"):
        validate_layout(spec, 1, 3)
    with pytest.raises(ParallelLayoutError, match="ep=2, etp=1: expert parallelism needs an MoE model"):
        validate_layout(spec, 1, 1, ep=2)
    validate_layout(spec, 2, 2)


def test_vocab_padding():
    spec = arch_from_hf(tiny_hf_config("llama"))  # vocab 97
    assert spec.padded_vocab_size(1) == 97
    assert spec.padded_vocab_size(2) == 98
    assert spec.padded_vocab_size(2, divisible_by=128) == 256


def test_parallel_state_reuse_and_mismatch():
    torch.set_num_threads(1)
    info = init_parallel(1, 1, 1)
    assert (info.tp, info.pp, info.dp, info.cp, info.cp_rank, info.world_size) == (1, 1, 1, 1, 0, 1)
    assert init_parallel(1, 1, 1) == info  # a second agent in the same process reuses the state
    with pytest.raises(ParallelStateError, match=r"world size 1 != tp\*pp\*cp\*dp = 2\*1\*1\*1"):
        init_parallel(2, 1, 1)
    with pytest.raises(ParallelStateError, match=r"world size 1 != tp\*pp\*cp\*dp = 1\*1\*2\*1"):
        init_parallel(1, 1, 1, cp=2)  # context-parallel ranks are ranks of the agent's world too


def test_shutdown_parallel_closes_the_world_and_a_new_one_can_start():
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    init_parallel(1, 1, 1)
    shutdown_parallel()
    assert not dist.is_initialized() and not mpu.model_parallel_is_initialized()
    shutdown_parallel()  # nothing left to close: a no-op
    assert init_parallel(1, 1, 1).world_size == 1  # later agents in this process start a fresh world


def test_a_world_left_open_is_closed_at_exit():
    """init_parallel's atexit hook destroys the world before interpreter teardown: a hook registered
    earlier (so run later) finds it closed, and the process exits 0."""
    import subprocess
    import sys

    script = (
        "import atexit, torch.distributed as dist\n"
        "atexit.register(lambda: print('open at exit:', dist.is_initialized()))\n"
        "from hacrl_megatron.models.parallel import init_parallel\n"
        "init_parallel(1, 1, 1)\n"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "open at exit: False" in out.stdout


def test_local_spec_parameter_names():
    init_parallel(1, 1, 1)
    model = build_gpt_model(arch_from_hf(tiny_hf_config("qwen3")))
    names = {n for n, _ in model.named_parameters()}
    assert {"decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
            "decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.1.mlp.linear_fc1.weight",
            "decoder.final_layernorm.weight", "embedding.word_embeddings.weight"} <= names
    assert "output_layer.weight" not in names  # tied: the output layer reuses the embedding


def test_missing_megatron_says_what_to_install(monkeypatch):
    import builtins

    from hacrl_megatron.models import parallel

    real_import = builtins.__import__

    def no_megatron(name, *args, **kwargs):
        if name.startswith("megatron"):
            raise ImportError("No module named 'megatron'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_megatron)
    with pytest.raises(ImportError, match="pip install 'megatron-core"):
        parallel.require_megatron()


def test_light_imports_without_heavy_backends():
    import subprocess
    import sys

    code = ("import sys; import hacrl_megatron.agents.local, hacrl_megatron.cli_convert; "
            "assert not any(m.startswith(('megatron', 'transformers')) for m in sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))


def test_local_spec_norm_supports_sequence_parallel():
    """The local spec's norms are torch's RMSNorm, bit for bit, with the weight marked for megatron's
    TP all-reduce of sequence-parallel gradients (megatron's own WrappedTorchNorm refuses SP)."""
    from types import SimpleNamespace

    from hacrl_megatron.models.local_spec import RMSNorm

    cfg = SimpleNamespace(normalization="RMSNorm", layernorm_zero_centered_gamma=False, sequence_parallel=True)
    norm, ref = RMSNorm(cfg, 16, eps=1e-6), torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
        ref.weight.copy_(norm.weight)
    x = torch.randn(5, 3, 16)
    assert torch.equal(norm(x), ref(x)) and norm.weight.sequence_parallel is True
    assert RMSNorm(SimpleNamespace(**{**vars(cfg), "sequence_parallel": False}), 16).weight.sequence_parallel is False
    init_parallel(1, 1, 1)
    model = build_gpt_model(arch_from_hf(tiny_hf_config("qwen3")))
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 2 * 2 + 2 * 2 + 1 and all(type(m) is RMSNorm for m in norms)  # layers, QK-norms, final
