"""``hacrl convert`` in this process (TP = PP = 1): HF → Megatron → HF, through the real CLI entry point."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from hacrl_megatron.cli import main as hacrl  # noqa: E402
from hacrl_megatron.models.convert import SafetensorsSource  # noqa: E402
from tests.distributed.megatron_helpers import make_tiny_hf  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def test_hf_to_megatron_to_hf_round_trip(tmp_path):
    torch.set_num_threads(1)
    hf = make_tiny_hf("qwen2", str(tmp_path / "hf"))
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    assert hacrl(["convert", "--from-hf", str(tmp_path / "hf"), "--to-megatron", str(tmp_path / "mg")]) == 0
    assert hacrl(["convert", "--from-megatron", str(tmp_path / "mg"), "--to-hf", str(tmp_path / "back")]) == 0
    out = SafetensorsSource(str(tmp_path / "back"))
    state = hf.state_dict()
    assert out.keys() == set(state)
    for name, tensor in state.items():
        assert torch.equal(out.get(name), tensor), name
    assert os.path.isfile(tmp_path / "back" / "tokenizer.json")  # carried along for the engines
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(str(tmp_path / "back")).model_type == "qwen2"


def test_converted_checkpoint_is_an_agent_init_checkpoint(tmp_path):
    from hacrl_megatron.agents.local import LocalAgent
    from tests.distributed.megatron_helpers import agent_config, sample_batch, train_config

    make_tiny_hf("llama", str(tmp_path / "hf"))
    assert hacrl(["convert", "--from-hf", str(tmp_path / "hf"), "--to-megatron", str(tmp_path / "mg")]) == 0
    from_hf = LocalAgent(agent_config("llama", str(tmp_path / "hf")), train_config())
    from hacrl_megatron.config import ModelConfig

    cfg = agent_config("llama", None)  # sizes only: random init, then the Megatron checkpoint
    cfg.model = ModelConfig(arch="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            ffn_hidden_size=64, vocab_size=97, max_position_embeddings=64, rope_theta=5000.0)
    cfg.init_checkpoint = str(tmp_path / "mg")
    from_megatron = LocalAgent(cfg, train_config())
    batch = sample_batch()
    assert torch.equal(from_hf.sequence_logprobs(batch)[0], from_megatron.sequence_logprobs(batch)[0])
    with pytest.raises(Exception, match="weights only"):
        from_megatron.load(str(tmp_path / "mg"))  # no optimizer state to resume from


def test_agent_checkpoint_is_convertible(tmp_path):
    from hacrl_megatron.agents.local import LocalAgent
    from tests.distributed.megatron_helpers import agent_config, sample_batch, sft_loss, train_config

    make_tiny_hf("llama", str(tmp_path / "hf"))
    agent = LocalAgent(agent_config("llama", str(tmp_path / "hf")), train_config())
    agent.train([sample_batch()], sft_loss)
    agent.save(str(tmp_path / "agent"))
    assert hacrl(["convert", "--from-megatron", str(tmp_path / "agent"), "--to-hf", str(tmp_path / "out")]) == 0
    out = SafetensorsSource(str(tmp_path / "out"))
    for name, tensor in agent.export_hf_weights():  # the trained weights, not the initial ones
        assert torch.equal(out.get(name), tensor), name


def test_bad_arguments_are_named(tmp_path, capsys):
    make_tiny_hf("llama", str(tmp_path / "hf"))
    assert hacrl(["convert", "--from-hf", str(tmp_path / "hf"), "--to-megatron", str(tmp_path / "x"), "--tp", "3"]) == 2
    assert "tp=3 does not divide num_attention_heads=4" in capsys.readouterr().err
    assert hacrl(["convert", "--from-megatron", str(tmp_path), "--gguf-file", "a.gguf", "--to-hf", "y"]) == 2
    assert "--gguf-file needs --from-hf" in capsys.readouterr().err
    assert hacrl(["convert", "--from-hf", str(tmp_path), "--to-hf", str(tmp_path / "z")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert hacrl(["convert", "--from-megatron", str(tmp_path / "hf"), "--to-hf", str(tmp_path / "z")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "hf") in err and "metadata.json is missing" in err
