"""The generations on disk (samples/step-NNNNNN.jsonl), in TensorBoard, and `hacrl samples`."""

from __future__ import annotations

import math

import pytest

from hacrl_megatron.algo import build_algorithm
from hacrl_megatron.cli import main
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.rollout.hf_engine import hf_sequence_logprob
from hacrl_megatron.samples_cli import read_samples, sample_steps
from hacrl_megatron.trainer import loop, stages
from hacrl_megatron.trainer.samples import _clipped, sample_rows, samples_path, writes_samples
from tests.e2e.test_trainer import parity_reward, run_with, tiny_exp
from tests.faults.trainer_helpers import exp_with


def _check_rows(rows, run, step, names=("llama", "qwen3")):
    exp, g = run.exp, run.exp.rollout.samples_per_prompt
    assert [r["index"] for r in rows] == list(range(exp.log.samples_prompts))
    records = run.task.sample(exp.train.prompts_per_step, offset=(step - 1) * exp.train.prompts_per_step)
    for row, record in zip(rows, records):  # the step's own prompts (step s trains on batch s - 1)
        assert row["step"] == step and (row["id"], row["question"], row["reference"]) == (
            record.id, record.question, record.answer)
        assert list(row["agents"]) == list(names)
        for source, completions in row["agents"].items():
            assert len(completions) == g
            for c in completions:
                assert c["reward"] in (0.0, 1.0) and c["length"] >= 0 and c["finish_reason"] in ("eos", "length")
                assert set(c["advantage"]) == set(names)  # HACPO: every learner trains on every agent's responses
                (other,) = [n for n in names if n != source]
                cross = c["cross"][other]
                if cross["ratio"] is not None:
                    assert 0 < cross["ratio"] and isinstance(cross["clipped"], bool)
    return rows


def test_samples_hold_question_reference_completions_and_per_learner_views(tmp_path):
    exp = exp_with(tiny_exp(tmp_path, steps=4), log={"samples_every": 3, "samples_prompts": 2, "samples_max_chars": 5})
    run, history = run_with(exp, steps=4)
    for rt in run.runtimes:
        rt.close()
    assert sorted(sample_steps(tmp_path / "run")) == [1, 3, 4]  # the first, every 3rd and the last step
    rows = _check_rows(read_samples(samples_path(exp.output_dir, 3)), run, 3)
    texts = [c for r in rows for cs in r["agents"].values() for c in cs]
    assert all(len(c["text"]) <= 5 for c in texts) and any(c["text_cut"] for c in texts)
    assert "time/samples_s" in history[2] and "time/samples_s" not in history[1]  # step 2 wrote none
    adv = [c["advantage"]["llama"] for c in rows[0]["agents"]["llama"]]
    rewards = [c["reward"] for c in rows[0]["agents"]["llama"]]
    if len(set(rewards)) > 1:  # a correct response gets a higher advantage than a wrong one of the same prompt
        assert min(a for a, r in zip(adv, rewards) if r == 1.0) > max(a for a, r in zip(adv, rewards) if r == 0.0)


def test_cross_ratio_is_the_learners_length_normalised_log_prob_gap(tmp_path):
    """The ratio written for learner k on agent j's response equals exp(Σ log π_k / L_k − Σ log π_j / L_j)
    (eq. 11), computed again from the engines' HF models (the same weights as the trainers before the step's
    updates) on each side's own view of the response. Tolerance 1e-4 relative: two float32 forward passes
    of a few tokens differ by ~1e-6 per token between the trainer and the engine model."""
    exp = exp_with(tiny_exp(tmp_path, steps=1), log={"samples_every": 1, "samples_prompts": 1})
    run = loop.setup(exp)
    run.verifier.close()
    run.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
    try:
        prompts = run.task.sample(exp.train.prompts_per_step)
        completions = stages.rollout(run.runtimes, prompts, exp, run.algorithm, 0)
        data = stages.verify(run.verifier, prompts, completions, 0, exp.rollout.max_response_len + 1)
        stages.old_logprobs(run.runtimes, data, run.exchange, run.algorithm, exp.rollout.temperature)
        run.tracker.update([0.5, 0.5])
        rows = sample_rows(run.runtimes, data, run.exchange, run.algorithm, run.tracker.omega(), None, exp, 1)
        checked = 0
        for learner, source in ((0, 1), (1, 0)):
            k, j = run.runtimes[learner], run.runtimes[source]
            for i, c in enumerate(rows[0]["agents"][j.name]):
                traj = data.trajectories[j.name][i]
                (kv,) = run.exchange.views(k.name, [traj], stages.prompt_id_map(k, prompts[:1]), record_stats=False)
                (jv,) = run.exchange.views(j.name, [traj], stages.prompt_id_map(j, prompts[:1]), record_stats=False)
                if kv.response_len == 0 or jv.response_len == 0:
                    assert c["cross"][k.name]["ratio"] is None
                    continue
                mean = [hf_sequence_logprob(rt.engine.model, list(v.input_ids[:v.prompt_len]),
                                            list(v.input_ids[v.prompt_len:]), exp.rollout.temperature) / v.response_len
                        for rt, v in ((k, kv), (j, jv))]
                assert c["cross"][k.name]["ratio"] == pytest.approx(math.exp(mean[0] - mean[1]), rel=1e-4)
                checked += 1
        assert checked >= 4
    finally:
        for rt in run.runtimes:
            rt.close()


def test_no_samples_when_turned_off_and_the_steps_that_write(tmp_path):
    exp = exp_with(tiny_exp(tmp_path, steps=25), log={"samples_every": 10})
    assert [s for s in range(1, 26) if writes_samples(exp, s)] == [1, 10, 20, 25]
    off = exp_with(exp, log={"samples_every": 0})
    assert not any(writes_samples(off, s) for s in range(1, 26))


@pytest.mark.parametrize("mode, log_s, adv, expected", [
    ("clamp", math.log(0.5), 1.0, True), ("clamp", math.log(0.9), -1.0, False), ("clamp", math.log(1.2), 0.0, True),
    ("pessimistic", math.log(0.5), 1.0, False), ("pessimistic", math.log(0.5), -1.0, True),
    ("decoupled", math.log(0.1), 1.0, False)])
def test_clipped_follows_the_first_updates_cross_window(tmp_path, mode, log_s, adv, expected):
    exp = exp_with(tiny_exp(tmp_path), hacpo={"cross_clip_mode": mode})
    algorithm = build_algorithm(exp.hacpo, 2)  # window [0.8, 1] at m = 0 (clamp, pessimistic)
    assert _clipped(log_s, adv, 0.0, algorithm) is expected
    assert _clipped(None, adv, 0.0, algorithm) is None
    naive = build_algorithm(exp_with(exp, hacpo={"algorithm": "naive"}).hacpo, 2)
    assert _clipped(log_s, adv, 0.0, naive) is None  # no cross window


def test_hacrl_samples_prints_a_step_readably(tmp_path, capsys):
    exp = exp_with(tiny_exp(tmp_path, steps=2), log={"samples_every": 1, "samples_prompts": 2})
    run, _ = run_with(exp, steps=2)
    for rt in run.runtimes:
        rt.close()
    folder = str(tmp_path / "run")
    assert main(["samples", folder, "--list"]) == 0 and capsys.readouterr().out.split() == ["1", "2"]
    assert main(["samples", folder, "--step", "1", "--agent", "qwen3", "--prompt", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 1 · prompt 1 · ") and "reference: " in out and "  qwen3: 4 completions" in out
    assert "  llama:" not in out and "[0] reward " in out and "  A llama=" in out and "  s llama=" in out
    assert main(["samples", folder]) == 0 and capsys.readouterr().out.startswith("step 2 · prompt 0")
    assert main(["samples", folder, "--step", "7"]) == 2
    assert capsys.readouterr().err.strip() == f"hacrl: --step 7: {folder} has samples of steps 1, 2"
    assert main(["samples", str(tmp_path)]) == 2
    assert "no samples/step-*.jsonl" in capsys.readouterr().err


def test_tensorboard_gets_a_text_panel_of_a_few_samples(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hacrl_megatron.trainer.metrics import MetricsLogger

    exp = exp_with(tiny_exp(tmp_path), log={"tensorboard": True, "jsonl": False})
    completion = {"text": "4`2", "text_cut": False, "reward": 1.0, "length": 2, "finish_reason": "eos",
                  "advantage": {"llama": 0.5, "qwen3": 0.25}}
    rows = [{"step": 3, "index": p, "id": f"q{p}", "question": f"{p}+1=?", "reference": str(p + 1),
             "agents": {"llama": [completion] * 3, "qwen3": [{**completion, "cross": {"llama": {"ratio": 0.9,
                                                                                             "clipped": False}}}] * 3}}
            for p in range(4)]
    out = MetricsLogger(exp, tmp_path / "tb_run", total_steps=3)
    out.log_samples(3, rows)
    out.close()
    events = EventAccumulator(str(tmp_path / "tb_run" / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    (tag,) = [t for t in events.Tags()["tensors"] if t.startswith("samples")]
    (event,) = events.Tensors(tag)
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3 and "**prompt 0** `q0`: 0+1=? → reference `1`" in text and "**prompt 2**" not in text
    assert text.count("- llama [") == 4 and "s llama=0.900" in text and "`4'2`" in text  # 2 prompts × 2 each


@pytest.mark.parametrize("mode", ["clamp", "pessimistic", "gspo"])
def test_clipped_flags_count_like_the_trained_cross_clipfrac(tmp_path, mode):
    """The per-sample flag agrees with the loss's own cross_clipfrac of update 0 (share among A ≠ 0)."""
    import torch

    from hacrl_megatron.algo.hacpo import cross_clipped_at_start, hacpo_metrics

    cfg = exp_with(tiny_exp(tmp_path), hacpo={"cross_clip_mode": mode}).hacpo
    gen = torch.Generator().manual_seed(0)
    log_s, adv = torch.randn(200, generator=gen, dtype=torch.float64) * 0.3, torch.randn(200, generator=gen).double()
    adv[::7] = 0.0
    flags = [cross_clipped_at_start(float(s), float(a), 0.0, cfg) for s, a in zip(log_s, adv)]
    counted = [f for f, a in zip(flags, adv) if a != 0]
    expected = hacpo_metrics(log_s, adv, torch.zeros(200, dtype=torch.bool), 0, cfg)["cross_clipfrac"]
    assert sum(counted) / len(counted) == pytest.approx(expected, abs=1e-12) and 0 < expected < 1
