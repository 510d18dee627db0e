"""End-to-end HACRL loop on tiny agents (a few steps each).

A random tiny model almost never solves addition, so these tests use a *parity* verifier (reward 1
when the response has an even number of characters) through VerifierPool's ``score_fn`` hook: it
gives every group non-uniform rewards, hence non-zero advantages and real gradients, while the
rest of the loop (rollout, exchange, ratios, updates, sync, checkpoints) is the real one.
"""

import copy
import dataclasses
import json

import pytest
import torch

from hacrl_megatron.agents.batch import SequenceBatch
from hacrl_megatron.config import ExperimentConfig, from_dict, validate
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.trainer import loop
from hacrl_megatron.trainer.checkpoint import MARKER, latest_checkpoint
from hacrl_megatron.trainer.run_folder import checkpoint_dir


def parity_reward(request, mode):
    return float(len(request.response) % 2 == 0)


def crashing_parity_reward(request, mode):
    if "7" in request.response:
        raise RuntimeError("verifier crashed on this response")
    return parity_reward(request, mode)


def tiny_exp(tmp_path, algorithm="hacpo", backend="hf", **train) -> ExperimentConfig:
    agent = lambda name, arch, tok, hidden, layers: {  # noqa: E731
        "name": name, "backend": backend, "tokenizer": tok, "prompt_template": "plain", "lr": 1e-3,
        "model": {"arch": arch, "hidden_size": hidden, "num_layers": layers, "num_heads": 4, "num_kv_heads": 2,
                  "ffn_hidden_size": 2 * hidden, "max_position_embeddings": 64},
    }
    return validate(from_dict(ExperimentConfig, {
        "name": "e2e", "output_dir": str(tmp_path / "run"),
        "agents": [agent("llama", "llama", "char", 32, 2), agent("qwen3", "qwen3", "pair", 24, 1)],
        "rollout": {"samples_per_prompt": 4, "max_response_len": 8, "max_prompt_len": 32},
        "hacpo": {"algorithm": algorithm},
        "train": {"steps": 2, "prompts_per_step": 4, "mini_batches": 2, "micro_batch_size": 8, "eval_every": 0,
                  "verifier_workers": 0, **train},
        "data": {"task": "addition", "difficulty": 1, "eval_size": 0},
        "checkpoint": {"every": 0},
        "log": {"tensorboard": False, "progress": False},
    }))


def run_with(exp, score_fn=parity_reward, steps=None):
    run = loop.setup(exp)
    run.verifier.close()
    run.verifier = VerifierPool(num_workers=0, score_fn=score_fn)
    history = [loop.train_step(run) for _ in range(steps if steps is not None else exp.train.steps)]
    return run, history


def split_run(exp, steps_before=2, steps_after=2):
    """Train ``steps_before`` steps, save, resume in a fresh setup, train ``steps_after`` more.

    Returns (first run, the resumed run's capability-tracker state right after resuming, the resumed
    steps' metrics)."""
    exp = dataclasses.replace(exp, checkpoint=dataclasses.replace(exp.checkpoint, every=steps_before))
    first, _ = run_with(exp, steps=steps_before)
    loop._save(first)
    resumed = loop.setup(dataclasses.replace(exp, checkpoint=dataclasses.replace(exp.checkpoint, resume=True)))
    resumed.verifier.close()
    resumed.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
    assert loop._resume(resumed) and resumed.step == steps_before
    tracker_at_resume = copy.deepcopy(resumed.tracker.state_dict())
    return first, tracker_at_resume, [loop.train_step(resumed) for _ in range(steps_after)]


def exported(rt) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in rt.trainer.export_hf_weights()}


@pytest.mark.parametrize(
    "algorithm, backend",
    [("hacpo", "hf"), ("naive", "hf"), ("gspo", "hf"), ("gspo_x2", "hf"), ("grpo", "hf"),
     ("hacpo", "megatron"), ("grpo", "megatron")],
)
def test_every_algorithm_trains_every_agent_and_syncs_engines(tmp_path, algorithm, backend):
    exp = tiny_exp(tmp_path, algorithm, backend=backend)
    run = loop.setup(exp)
    run.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
    before = {rt.name: exported(rt) for rt in run.runtimes}
    history = [loop.train_step(run) for _ in range(2)]
    for rt in run.runtimes:
        after = exported(rt)
        for key, value in after.items():
            assert not torch.equal(value, before[rt.name][key]), f"{rt.name}.{key} did not change"
        engine_state = rt.engine.model.state_dict()
        for key, value in after.items():
            torch.testing.assert_close(engine_state[key], value, rtol=0, atol=0)  # the engine got the new weights
        for metrics in history:
            assert torch.isfinite(torch.tensor(metrics[f"{rt.name}/hacpo/loss"]))
            assert metrics[f"{rt.name}/sync_logp_diff"] < 1e-3
            if algorithm != "grpo":  # first update is on-policy: ratio 1 (exactly, with the batch-invariant kernel)
                limit = 0.0 if backend == "megatron" else 1e-5
                assert metrics[f"{rt.name}/hacpo/onpolicy_ratio_dev"] <= limit
    g = exp.rollout.samples_per_prompt * (2 if algorithm == "gspo_x2" else 1)
    n_seq = history[0]["llama/sequences"]
    shared = algorithm in ("hacpo", "naive")
    assert n_seq == exp.train.prompts_per_step * g * (2 if shared else 1)
    if shared:
        assert history[0]["llama/hacpo/num_cross"] > 0
        assert 0.1 <= history[0]["llama/omega/qwen3"] <= 10


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_resumed_run_matches_uninterrupted(tmp_path, backend):
    full_exp = tiny_exp(tmp_path / "full", steps=4, backend=backend)
    _, full = run_with(full_exp)
    _, _, later = split_run(tiny_exp(tmp_path / "split", steps=4, backend=backend))
    for name in ("llama", "qwen3"):
        for a, b in zip(full[2:], later):
            assert a[f"{name}/hacpo/loss"] == pytest.approx(b[f"{name}/hacpo/loss"], rel=1e-6, abs=1e-9)
            assert a[f"{name}/reward_mean"] == b[f"{name}/reward_mean"]


def test_crash_mid_save_resumes_from_last_complete_checkpoint(tmp_path):
    exp = tiny_exp(tmp_path, steps=2)
    run, _ = run_with(exp, steps=1)
    loop._save(run)
    root = checkpoint_dir(exp)
    # a save killed before its rename leaves a temp folder; one killed before the marker, no COMPLETE
    (root / ".tmp-step-000002-999999" / "agents").mkdir(parents=True)
    (root / "step-000002" / "agents").mkdir(parents=True)
    assert latest_checkpoint(root).name == "step-000001"
    fresh = loop.setup(dataclasses.replace(exp, checkpoint=dataclasses.replace(exp.checkpoint, resume=True)))
    assert loop._resume(fresh) and fresh.step == 1
    assert (latest_checkpoint(root) / MARKER).exists()


def test_verifier_crash_on_one_response_does_not_stop_the_run(tmp_path):
    run, history = run_with(tiny_exp(tmp_path), score_fn=crashing_parity_reward)
    assert run.step == 2
    assert run.verifier.stats["errors"] > 0  # responses containing "7" crashed the checker and scored 0


def test_full_train_writes_metrics_checkpoints_and_table(tmp_path, capsys):
    exp = tiny_exp(tmp_path, steps=2)
    exp = dataclasses.replace(
        exp,
        train=dataclasses.replace(exp.train, eval_every=2),
        data=dataclasses.replace(exp.data, eval_size=8),
        checkpoint=dataclasses.replace(exp.checkpoint, every=1, keep=1),
    )
    run = loop.train(exp)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "llama/eval_accuracy" in rows[-1] and "qwen3/hacpo/cross_clipfrac" in rows[1]
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")] == ["step-000002"]  # keep=1
    assert "| llama |" in capsys.readouterr().out
    assert run.step == 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hacrl_megatron.rollout.hf_engine import hf_sequence_logprob

    for rt in run.runtimes:  # the exported folder is a standalone HF model scoring like the trainer
        folder = tmp_path / "run" / "final" / rt.name
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert AutoTokenizer.from_pretrained(folder).encode("3+4") == rt.tokenizer.encode("3+4")
        prompt, response = rt.prompt_ids("3+4=?"), rt.tokenizer.encode("\\boxed{7}")
        batch_sum, _ = rt.trainer.sequence_logprobs(
            SequenceBatch((torch.tensor(prompt + response),), torch.tensor([len(prompt)])))
        assert hf_sequence_logprob(model, prompt, response) == pytest.approx(float(batch_sum[0]), abs=1e-4)


def test_sglang_engine_path_with_a_stand_in_server(tmp_path):
    """`rollout.engine: sglang` on CPU: one server process per agent (a stand-in speaking SGLang's
    HTTP API, backed by the agent's HF folder), weight sync after every step (auto: distributed, over gloo)."""
    import sys
    from pathlib import Path

    from hacrl_megatron.rollout import HFEngine, SamplingParams

    script = Path(__file__).resolve().parents[1] / "fixtures" / "fake_sglang_server.py"
    exp = tiny_exp(tmp_path)
    command = [sys.executable, str(script), "--model-path", "{model_path}", "--port", "{port}"]
    exp = dataclasses.replace(exp, rollout=dataclasses.replace(
        exp.rollout, engine="sglang", sglang=dataclasses.replace(exp.rollout.sglang, command=command)))
    run = loop.setup(exp)
    try:
        run.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
        for _ in range(2):
            loop.train_step(run)
        for rt in run.runtimes:
            assert rt.engine.weight_version == 2  # one disk sync per step
            local = HFEngine(rt.trainer.model, rt.tokenizer)
            params = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
            prompt = [rt.prompt_ids("3+4=?")]
            assert rt.engine.generate(prompt, params)[0][0].token_ids == local.generate(prompt, params)[0][0].token_ids
    finally:
        for rt in run.runtimes:
            rt.close()


@pytest.mark.distributed
def test_agents_with_different_layouts_train_side_by_side(tmp_path):
    """Agent 0 at TP=2 as a Ray worker group (its own 2-rank gloo world), agent 1 local at TP=1."""
    pytest.importorskip("ray")
    exp = tiny_exp(tmp_path, backend="megatron")
    first = dataclasses.replace(exp.agents[0], workers="ray", parallel=dataclasses.replace(exp.agents[0].parallel, tp=2))
    exp = validate(dataclasses.replace(exp, agents=[first, exp.agents[1]]))
    run = loop.setup(exp)
    try:
        run.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
        before = {rt.name: exported(rt) for rt in run.runtimes}
        history = [loop.train_step(run) for _ in range(2)]
        for rt in run.runtimes:
            after = exported(rt)
            assert all(not torch.equal(after[k], before[rt.name][k]) for k in after)
            assert all(m[f"{rt.name}/sync_logp_diff"] < 1e-3 for m in history)
    finally:
        for rt in run.runtimes:
            rt.close()


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_agents_start_from_an_hf_checkpoint_dir(tmp_path, backend):
    """init_checkpoint (e.g. the cached warm-up) is an HF folder: both backends start from its weights."""
    exp = tiny_exp(tmp_path, backend=backend)
    seed_run = loop.setup(dataclasses.replace(exp, agents=[dataclasses.replace(exp.agents[0], backend="hf"), exp.agents[1]]))
    saved = tmp_path / "init"
    seed_run.runtimes[0].trainer.model.save_pretrained(saved)
    expected = exported(seed_run.runtimes[0])
    exp = dataclasses.replace(exp, agents=[dataclasses.replace(exp.agents[0], init_checkpoint=str(saved)), exp.agents[1]])
    run = loop.setup(exp)
    got = exported(run.runtimes[0])
    assert set(got) <= set(expected) and len(got) >= len(expected) - 1  # tied lm_head may be exported once
    for key, value in got.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0)


def test_warmup_cache_key_tracks_only_what_shapes_the_weights(tmp_path):
    from hacrl_megatron.trainer.pretrain import warmup_dir

    exp = tiny_exp(tmp_path)
    base = warmup_dir(exp, 0)
    same = dataclasses.replace(exp, agents=[dataclasses.replace(exp.agents[0], lr=0.5, rollout_gpu_ids=[3]),
                                            exp.agents[1]])
    assert warmup_dir(same, 0) == base  # RL learning rate and rollout GPUs do not shape the warm-up
    other_data = dataclasses.replace(exp, data=dataclasses.replace(exp.data, path="elsewhere.jsonl"))
    assert warmup_dir(other_data, 0) != base
    other_model = dataclasses.replace(exp, agents=[dataclasses.replace(
        exp.agents[0], model=dataclasses.replace(exp.agents[0].model, hidden_size=64)), exp.agents[1]])
    assert warmup_dir(other_model, 0) != base
