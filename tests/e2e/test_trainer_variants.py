"""The HACPO cross-term variants through the real loop (docs/algorithm.md §5a-5d) on the tiny agents of
test_trainer.py: per-pair metrics, the adaptive window's centre from the running median, and exact
resume of that running state from a checkpoint."""

import dataclasses

import pytest
import torch

from hacrl_megatron.algo import adaptive_center, build_algorithm
from tests.e2e.test_trainer import run_with, split_run, tiny_exp


def variant_exp(path, steps=4, **hacpo):
    exp = tiny_exp(path, steps=steps)
    return dataclasses.replace(exp, hacpo=dataclasses.replace(exp.hacpo, **hacpo))


def test_adaptive_pessimistic_metrics_and_centres(tmp_path):
    exp = variant_exp(tmp_path, steps=3, cross_clip_mode="pessimistic", cross_window="adaptive",
                      adaptive_window_steps=2)
    run, history = run_with(exp)
    for learner, source in (("llama", "qwen3"), ("qwen3", "llama")):
        prefix = f"{learner}/hacpo/"
        for metrics in history:
            for key in (f"cross_clipfrac/{source}/pos", f"cross_clipfrac/{source}/neg", f"cross_center/{source}",
                        f"cross_log_ratio_median/{source}"):
                assert prefix + key in metrics, prefix + key
        assert history[0][f"{prefix}cross_center/{source}"] == 0.0  # no history at step 0: the paper's window
        # step 2's centre comes from the medians of steps 0 and 1 (K = 2)
        medians = [history[i][f"{prefix}cross_log_ratio_median/{source}"] for i in (0, 1)]
        want = adaptive_center(sum(medians) / 2, exp.hacpo)
        assert history[2][f"{prefix}cross_center/{source}"] == pytest.approx(want, abs=1e-9)
    k, j = 0, 1
    assert run.tracker.median_log_ratio(k, j) == pytest.approx(
        sum(history[i]["llama/hacpo/cross_log_ratio_median/qwen3"] for i in (1, 2)) / 2)


def test_fixed_window_reports_zero_centre_and_keeps_no_pair_history(tmp_path):
    run, history = run_with(variant_exp(tmp_path, steps=1))
    assert history[0]["llama/hacpo/cross_center/qwen3"] == 0.0
    assert run.tracker.median_log_ratio(0, 1) is None


def test_adaptive_window_resumes_exactly(tmp_path):
    settings = dict(cross_clip_mode="pessimistic", cross_window="adaptive", adaptive_window_steps=3)
    _, full = run_with(variant_exp(tmp_path / "full", **settings))
    first, tracker_at_resume, later = split_run(variant_exp(tmp_path / "split", **settings))
    assert tracker_at_resume == first.tracker.state_dict()
    for a, b in zip(full[2:], later):
        for key in ("llama/hacpo/cross_center/qwen3", "qwen3/hacpo/cross_center/llama", "llama/hacpo/loss",
                    "qwen3/hacpo/loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    assert full[2]["llama/hacpo/cross_center/qwen3"] != 0.0  # the tiny agents' ratios sit far from 1


def test_gspo_clip_without_hacpo_weights_trains_exactly_like_naive(tmp_path):
    """§5c with the −Adv, −ω and α = 0 ablations is Naive: the same losses, step after step."""
    gspo_clip = dict(cross_clip_mode="gspo", alpha=0.0, discrepancy_coefficient=False,
                     capability_aware_advantage=False)
    _, variant = run_with(variant_exp(tmp_path / "variant", steps=2, **gspo_clip))
    _, naive = run_with(variant_exp(tmp_path / "naive", steps=2, algorithm="naive"))
    _, paper = run_with(variant_exp(tmp_path / "paper", steps=2))
    for a, b in zip(variant, naive, strict=True):
        for key in ("llama/hacpo/loss", "qwen3/hacpo/loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    assert variant[1]["llama/hacpo/loss"] != pytest.approx(paper[1]["llama/hacpo/loss"], rel=1e-3)


@pytest.mark.parametrize("backend, agents", [("hf", 2), ("megatron", 2), ("hf", 3)])
def test_decoupled_first_update_is_on_policy_for_cross_samples(tmp_path, backend, agents):
    """§5d: with one update per step every cross sample sits at r = 1 exactly (the learner's π_old pass on
    the other agent's responses equals its training forward), so none is clipped; each one is weighted
    by w = min(1, s_old) < 1 on average, and the agents train."""
    exp = variant_exp(tmp_path, steps=2, cross_clip_mode="decoupled")
    third = dataclasses.replace(exp.agents[0], name="llama_b", model=dataclasses.replace(exp.agents[0].model, hidden_size=16))
    exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, mini_batches=1),
                              agents=[dataclasses.replace(a, backend=backend) for a in [*exp.agents, third][:agents]])
    run, history = run_with(exp)
    names = [a.name for a in exp.agents]
    for learner in names:  # with three agents each learner's π_old pass covers two sources, in config order
        for metrics in history:
            assert metrics[f"{learner}/hacpo/cross_clipfrac"] == 0.0
            for source in names:
                if source != learner:
                    assert metrics[f"{learner}/hacpo/cross_clipfrac/{source}/pos"] == 0.0
                    assert metrics[f"{learner}/hacpo/cross_clipfrac/{source}/neg"] == 0.0
            assert 0.0 < metrics[f"{learner}/hacpo/cross_behaviour_weight_mean"] <= 1.0
            assert metrics[f"{learner}/hacpo/grad_norm"] > 0.0
    # the same steps under the paper's clamp clip part of those samples
    _, paper = run_with(variant_exp(tmp_path / "paper", steps=1))
    assert paper[0]["llama/hacpo/cross_clipfrac"] > 0.0


def test_decoupled_learner_batch_carries_the_learner_old_log_probs(tmp_path):
    """Self rows carry the source's own Σ log π_old; cross rows the learner's, computed once per step."""
    from hacrl_megatron.trainer import stages

    exp = variant_exp(tmp_path, steps=1, cross_clip_mode="decoupled")
    run, _ = run_with(exp, steps=0)
    decoupled, temperature = run.algorithm, exp.rollout.temperature
    assert decoupled.passes.learner_old_on_others
    prompts = run.task.sample(exp.train.prompts_per_step, offset=0)
    data = stages.verify(run.verifier, prompts, stages.rollout(run.runtimes, prompts, exp, decoupled, 0), 0,
                         exp.rollout.max_response_len + 1)
    omega = torch.ones(2, 2, dtype=torch.float64)
    clamp = build_algorithm(dataclasses.replace(exp.hacpo, cross_clip_mode="clamp"), 2)
    assert not clamp.passes.learner_old_on_others
    stages.old_logprobs(run.runtimes, data, run.exchange, clamp, temperature)  # fills no learner π_old on cross samples
    with pytest.raises(ValueError, match="no π_old of learner 'llama' on agent 'qwen3''s responses"):
        stages.learner_batch(run.runtimes[0], run.runtimes, data, run.exchange, omega, decoupled)
    stages.old_logprobs(run.runtimes, data, run.exchange, decoupled, temperature)
    llama = run.runtimes[0]
    batch = stages.learner_batch(llama, run.runtimes, data, run.exchange, omega, decoupled)
    inputs = batch.loss_inputs
    own = inputs.is_self
    torch.testing.assert_close(inputs.learner_old_logp_sum[own], inputs.source_logp_sum[own].double())
    views = run.exchange.views("llama", data.trajectories["qwen3"], stages.prompt_id_map(llama, prompts),
                               record_stats=False)
    keep = [i for i, v in enumerate(views) if v.response_len > 0]
    fresh, _ = llama.trainer.sequence_logprobs(stages.views_to_batch([views[i] for i in keep]), temperature)
    torch.testing.assert_close(inputs.learner_old_logp_sum[~own], torch.as_tensor(fresh, dtype=torch.float64))
    plain = stages.learner_batch(llama, run.runtimes, data, run.exchange, omega, clamp)
    assert plain.loss_inputs.learner_old_logp_sum is None
