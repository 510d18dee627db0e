"""Fault injection on checkpoint conversion: damaged safetensors are named (item 9), bfloat16
checkpoints round-trip bit-identical in dtype too (item 16), and worlds leave no temporary
folders behind (item 18)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from hacrl_megatron.cli import main as hacrl  # noqa: E402
from hacrl_megatron.models.convert import CorruptCheckpointError, SafetensorsSource  # noqa: E402
from hacrl_megatron.models.parallel import local_rendezvous  # noqa: E402
from tests.distributed.megatron_helpers import make_tiny_hf, tiny_hf_config  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "model.norm")


def _bf16_qwen3(out_dir: str):
    """A tiny random Qwen3 saved in bfloat16 (norm weights perturbed so every value matters)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("qwen3"), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(out_dir)
    return model


def _tensors(folder) -> dict[str, torch.Tensor]:
    src = SafetensorsSource(str(folder))
    return {name: src.get(name) for name in src.keys()}


# -- item 16: bf16 round trips keep every tensor's dtype ---------------------------------------------


def test_bf16_qwen3_hf_megatron_hf_round_trip_is_bit_identical_in_dtype(tmp_path):
    torch.set_num_threads(1)
    model = _bf16_qwen3(str(tmp_path / "hf"))
    assert hacrl(["convert", "--from-hf", str(tmp_path / "hf"), "--to-megatron", str(tmp_path / "mg")]) == 0
    assert hacrl(["convert", "--from-megatron", str(tmp_path / "mg"), "--to-hf", str(tmp_path / "back")]) == 0
    back = _tensors(tmp_path / "back")
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert set(back) == set(state)
    norms = [n for n in back if any(k in n for k in NORMS)]
    assert len(norms) == 2 * 4 + 1  # per layer: input, post-attention, q_norm, k_norm; and the final norm
    for name, tensor in state.items():
        assert back[name].dtype == torch.bfloat16, name
        assert torch.equal(back[name], tensor), name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"


def test_bf16_agent_export_writes_bf16_norms(tmp_path):
    """The trainer's final/ export: the agent's HF stream written by save_hf_checkpoint."""
    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.models.convert import save_hf_checkpoint
    from tests.distributed.megatron_helpers import agent_config, train_config

    torch.set_num_threads(1)
    model = _bf16_qwen3(str(tmp_path / "hf"))
    cfg = agent_config("qwen3", str(tmp_path / "hf"))
    cfg.model.dtype = "bfloat16"
    agent = LocalAgent(cfg, train_config())
    save_hf_checkpoint(agent.export_hf_weights(), agent.hf_config, str(tmp_path / "final"))
    with safe_open(str(tmp_path / "final" / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert set(dtypes.values()) == {"BF16"}, {n: d for n, d in dtypes.items() if d != "BF16"}
    exported = _tensors(tmp_path / "final")
    for name, tensor in model.state_dict().items():
        if name in exported:
            assert torch.equal(exported[name], tensor), name


# -- item 9: a damaged safetensors file is named -----------------------------------------------------


def _damage(path, how: str) -> None:
    data = path.read_bytes()
    damaged = {"utf8": data[:8] + b"\xff\xfe" + data[10:], "truncated": data[:-64], "empty": b""}[how]
    path.write_bytes(damaged)


@pytest.mark.parametrize("how", ["utf8", "truncated", "empty"])
def test_convert_names_a_damaged_safetensors_file(tmp_path, capsys, how):
    make_tiny_hf("llama", str(tmp_path / "hf"))
    weights = tmp_path / "hf" / "model.safetensors"
    _damage(weights, how)
    rc = hacrl(["convert", "--from-hf", str(tmp_path / "hf"), "--to-megatron", str(tmp_path / "mg")])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"hacrl convert: {weights}: not a readable safetensors file" in err
    assert not (tmp_path / "mg").exists()


def test_sharded_checkpoint_with_a_damaged_or_missing_shard_is_named_up_front(tmp_path):
    from hacrl_megatron.models.convert import save_hf_checkpoint

    state = {f"t{i}": torch.randn(64, 64) for i in range(4)}
    save_hf_checkpoint(iter(state.items()), tiny_hf_config("llama"), str(tmp_path), max_shard_bytes=40_000)
    shards = sorted(p for p in tmp_path.iterdir() if p.suffix == ".safetensors")
    assert len(shards) >= 2
    assert _tensors(tmp_path).keys() == state.keys()
    _damage(shards[1], "utf8")
    with pytest.raises(CorruptCheckpointError, match=f"{shards[1]}: not a readable safetensors file"):
        SafetensorsSource(str(tmp_path))  # the header of every shard is read when the source opens
    shards[1].unlink()
    with pytest.raises(CorruptCheckpointError, match=f"{shards[1]}: safetensors file listed by the checkpoint"):
        SafetensorsSource(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CorruptCheckpointError, match="model.safetensors.index.json: not a safetensors index"):
        SafetensorsSource(str(tmp_path))


# -- item 18: temporary rendezvous folders are removed -------------------------------------------------


def test_local_rendezvous_folder_is_removed_also_on_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with local_rendezvous("hacrl_convert_") as init_file:
        assert os.path.isdir(os.path.dirname(init_file)) and not os.path.exists(init_file)
    with pytest.raises(RuntimeError, match="a rank failed"), local_rendezvous("hacrl_convert_"):
        raise RuntimeError("a rank failed")
    assert list(tmp_path.iterdir()) == []


def test_single_process_world_leaves_no_store_folder(tmp_path):
    script = textwrap.dedent("""
        import warnings
        warnings.filterwarnings("ignore")
        from hacrl_megatron.models.parallel import init_parallel
        init_parallel(1, 1, 1)
    """)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HACRL_DIST_INIT_FILE"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("hacrl_")) == []


@pytest.mark.slow
def test_convert_tp2_world_leaves_no_rendezvous_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    make_tiny_hf("llama", str(tmp_path / "hf"))
    assert hacrl(["convert", "--from-hf", str(tmp_path / "hf"), "--to-megatron", str(tmp_path / "mg"),
                  "--tp", "2"]) == 0
    assert [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("hacrl_convert_")] == []
    # an unusable output folder is now refused before any rank starts (outputs.py), and leaves nothing either;
    # a rank failing inside a spawned world is covered by tests/unit/test_parallel_spawn.py (injected failures)
    (tmp_path / "blocker").write_text("a file where the output folder should go")
    assert hacrl(["convert", "--from-hf", str(tmp_path / "hf"), "--to-hf", str(tmp_path / "blocker" / "out"),
                  "--tp", "2"]) == 2
    assert [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("hacrl_convert_")] == []
