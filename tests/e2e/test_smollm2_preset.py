"""The `smollm2_demo` preset end to end: the real SmolLM2-135M-Instruct (49k BPE, chat template)
trains with the tiny Qwen3-style agent (digit-pair BPE) through the whole loop for two steps."""

import json

import pytest

from hacrl_megatron.config import load_config
from hacrl_megatron.trainer import loop

pytestmark = pytest.mark.slow


def test_smollm2_preset_trains_two_steps(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    monkeypatch.setenv("HACRL_CACHE", str(tmp_path / "cache"))
    exp = load_config("smollm2_demo", [
        f"output_dir={tmp_path / 'run'}", "train.steps=2", "train.eval_every=0", "agents.1.warmup_sft_max_steps=20",
        "log.progress=false", "log.tensorboard=false", "checkpoint.every=0", "train.verifier_workers=0",
    ])
    run = loop.train(exp)
    assert run.step == 2
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    last = rows[-1]
    assert last["smollm2/sync_logp_diff"] < 1e-3 * 49  # fp32 Megatron vs HF on the probe sequence
    # genuinely different tokenizers: the pair BPE needs >1.5x SmolLM2's tokens for the same text
    assert last["qwen3/exchange/from_smollm2/token_ratio"] > 1.5


def test_smollm2_preset_prompt_gives_reward_signal(monkeypatch):
    """Asked plainly (the default chat instruction) SmolLM2 writes an empty box before the equation
    and scores ~0; with the preset's one-shot prompt it writes `a+b = s, so the answer is \\boxed{s}`
    and scores well above 0 greedily (not 1: the 135M model adds wrongly), so RL has signal and room."""
    pytest.importorskip("gguf")
    from hacrl_megatron.data import make_task
    from hacrl_megatron.eval.evaluate import EvalSettings, evaluate
    from hacrl_megatron.eval.run import load_hf_agent
    from hacrl_megatron.reward.pool import VerifierPool

    exp = load_config("smollm2_demo")
    engine, tokenizer = load_hf_agent("smollm2")
    records = make_task(exp.data.task, exp.data.difficulty, exp.data.seed).eval_set(50)  # the run's eval items
    accuracy = {}
    with VerifierPool(num_workers=0) as verifier:
        for name, template in (("preset", exp.agents[0].prompt_template), ("chat", "chat")):
            settings = EvalSettings(greedy=True, max_new_tokens=exp.rollout.max_response_len, template=template)
            result = evaluate(engine, tokenizer, {"eval": records}, settings, verifier=verifier)
            accuracy[name] = result.benchmarks["eval"].primary
    assert accuracy["chat"] <= 0.04, accuracy
    assert 0.2 <= accuracy["preset"] <= 0.8, accuracy
