"""HF ↔ Megatron conversion at TP = PP = 1 in this process, and the sharding math for TP > 1.

The 2-process tests (tests/distributed/test_megatron_worlds.py) repeat the equalities at TP = 2 and
PP = 2; here the per-rank shard functions are also checked directly for TP = 2 and 4 by building
every rank's shard in one process and re-assembling them.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from hacrl_megatron.models import convert, export  # noqa: E402
from hacrl_megatron.models.provider import arch_from_hf, build_gpt_model  # noqa: E402
from tests.distributed.megatron_helpers import ARCHS, VOCAB, make_tiny_hf, tiny_hf_config  # noqa: E402

warnings.filterwarnings("ignore", category=UserWarning)


@pytest.fixture(scope="module")
def world():
    from hacrl_megatron.models.parallel import init_parallel

    torch.set_num_threads(1)
    return init_parallel(1, 1, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hf")
    return {arch: (make_tiny_hf(arch, str(root / arch)), str(root / arch)) for arch in ARCHS}


def _megatron(arch_dir: str):
    from transformers import AutoConfig

    spec = arch_from_hf(AutoConfig.from_pretrained(arch_dir))
    model = build_gpt_model(spec)
    convert.load_hf_weights(model, spec, arch_dir)
    return spec, model.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_hf(world, tiny, arch):
    hf, path = tiny[arch]
    _, model = _megatron(path)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids, torch.arange(11).expand(2, -1), None)
        ref = hf(ids).logits
    assert ours.shape == ref.shape == (2, 11, VOCAB)
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel <= 1e-5, f"{arch}: max relative logit error {rel:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_megatron_hf_is_bit_identical(world, tiny, arch, tmp_path):
    hf, path = tiny[arch]
    spec, model = _megatron(path)
    exported = dict(export.export_hf_weights(model, spec))
    expected = {k: v for k, v in hf.state_dict().items() if not (spec.tie_embeddings and k == "lm_head.weight")}
    assert set(exported) == set(expected)
    for name, tensor in exported.items():
        assert torch.equal(tensor, expected[name]), name
    # the written directory is save_pretrained-compatible and reloads to the same logits
    from transformers import AutoModelForCausalLM

    files = convert.save_hf_checkpoint(export.export_hf_weights(model, spec), hf.config, str(tmp_path / "out"))
    assert files == ["config.json", "model.safetensors"]
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    ids = torch.arange(10).unsqueeze(0)
    assert torch.equal(again(ids).logits, hf(ids).logits)


def test_sharded_writer_index(world, tiny, tmp_path):
    hf, path = tiny["qwen2"]
    spec, model = _megatron(path)
    files = convert.save_hf_checkpoint(export.export_hf_weights(model, spec), hf.config, str(tmp_path), max_shard_bytes=20_000)
    assert files[-1] == "model.safetensors.index.json" and len(files) > 3
    src = convert.SafetensorsSource(str(tmp_path))
    for name, tensor in hf.state_dict().items():
        assert torch.equal(src.get(name), tensor), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_reassemble(arch, tp):
    """Each rank's shard (QKV groups, gate/up halves, row/column splits, padded vocab) re-gathers exactly."""
    cfg = tiny_hf_config(arch, tie=False)
    cfg.num_key_value_heads = 4 if tp == 4 else 2
    spec = arch_from_hf(cfg)
    g = torch.Generator().manual_seed(0)
    hf_sd = {}
    for layer_name in ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]:
        hf_sd[layer_name] = torch.randn(convert.hf_shape(spec, layer_name), generator=g)
    names = ["self_attention.linear_qkv.weight", "mlp.linear_fc1.weight", "self_attention.linear_proj.weight",
             "mlp.linear_fc2.weight", "input_layernorm.weight"]
    if spec.qkv_bias:
        names.append("self_attention.linear_qkv.bias")
    plans = {n: convert.plan_for(spec, f"decoder.layers.1.{n}", 0) for n in names}
    plans["embedding.word_embeddings.weight"] = convert.plan_for(spec, "embedding.word_embeddings.weight", 0)
    plans["output_layer.weight"] = convert.plan_for(spec, "output_layer.weight", 0)
    for plan in plans.values():
        for hf_name in plan.hf_names:
            hf_sd.setdefault(hf_name, torch.randn(convert.hf_shape(spec, hf_name), generator=g))
    src = convert.DictSource(hf_sd)
    padded = spec.padded_vocab_size(tp)
    for name, plan in plans.items():
        local = (padded // tp, spec.hidden_size) if plan.kind == "vocab" else None
        shards = [convert.megatron_shard(spec, plan, src, local, r, tp) for r in range(tp)]
        assert len({s.shape for s in shards}) == 1, name
        for hf_name, tensor in zip(plan.hf_names, convert._to_hf(spec, plan, shards)):
            assert torch.equal(tensor, hf_sd[hf_name]), (name, hf_name)
    if VOCAB % tp:  # padded rows are zero
        emb = convert.megatron_shard(spec, plans["embedding.word_embeddings.weight"], src, (padded // tp, 32), tp - 1, tp)
        assert torch.all(emb[-(padded - VOCAB):] == 0)


def test_qkv_layout_is_grouped_per_kv_head():
    """Megatron's fused QKV: per KV group, its query heads, then its key head, then its value head."""
    cfg = tiny_hf_config("llama")  # 4 heads, 2 KV heads, head_dim 8
    spec = arch_from_hf(cfg)
    q = torch.arange(32).repeat_interleave(1).float().unsqueeze(1).expand(32, 32)
    k = 100 + torch.arange(16).float().unsqueeze(1).expand(16, 32)
    v = 200 + torch.arange(16).float().unsqueeze(1).expand(16, 32)
    src = convert.DictSource({"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
                              "model.layers.0.self_attn.v_proj.weight": v})
    plan = convert.plan_for(spec, "decoder.layers.0.self_attention.linear_qkv.weight", 0)
    fused = convert.megatron_shard(spec, plan, src, None, 0, 1)[:, 0]
    expected = torch.cat([torch.arange(16), 100 + torch.arange(8), 200 + torch.arange(8),
                          16 + torch.arange(16), 108 + torch.arange(8), 208 + torch.arange(8)]).float()
    assert torch.equal(fused, expected)


def test_checkpoint_of_other_size_names_the_tensor(world, tiny, tmp_path):
    _, path = tiny["llama"]
    make_tiny_hf("llama", str(tmp_path / "wide"), vocab=VOCAB + 3)
    from transformers import AutoConfig

    spec = arch_from_hf(AutoConfig.from_pretrained(path))
    model = build_gpt_model(spec)
    with pytest.raises(convert.CheckpointMismatchError, match="model.embed_tokens.weight.*shape"):
        convert.load_hf_weights(model, spec, str(tmp_path / "wide"))
    # a llama checkpoint loaded into a qwen3 model: qwen3's q_norm has no source tensor
    spec3 = arch_from_hf(tiny_hf_config("qwen3"))
    with pytest.raises(convert.CheckpointMismatchError, match="no tensor 'model.layers.0.self_attn.q_norm.weight'"):
        convert.load_hf_weights(build_gpt_model(spec3), spec3, path)


def test_safetensors_source_reads_slices(tiny):
    _, path = tiny["llama"]
    src = convert.SafetensorsSource(path)
    full = src.get("model.layers.0.self_attn.o_proj.weight")
    assert torch.equal(src.get("model.layers.0.self_attn.o_proj.weight", 1, 8, 24), full[:, 8:24])
    assert torch.equal(src.get("model.layers.0.self_attn.o_proj.weight", 0, 4, 9), full[4:9])
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        convert.SafetensorsSource(os.path.dirname(path))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Transformer Engine layer spec)")
@pytest.mark.parametrize("arch", ARCHS)
def test_transformer_engine_spec_matches_hf_on_gpu(tiny, arch):
    """GPU: the TE layer spec (fused layer-norm names) converts both ways and matches HF."""
    pytest.importorskip("transformer_engine")
    from transformers import AutoConfig

    from hacrl_megatron.models.parallel import init_parallel

    init_parallel(1, 1, 1)
    hf, path = tiny[arch]
    spec = arch_from_hf(AutoConfig.from_pretrained(path))
    model = build_gpt_model(spec, te=True)
    names = {n for n, _ in model.named_parameters()}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    convert.load_hf_weights(model, spec, path)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        ours = model.eval()(ids, torch.arange(11, device="cuda").expand(2, -1), None).float().cpu()
        ref = hf(ids.cpu()).logits
    assert float((ours - ref).abs().max() / ref.abs().max()) <= 1e-4
    for name, tensor in export.export_hf_weights(model, spec):
        assert torch.equal(tensor.cpu(), hf.state_dict()[name]), name
