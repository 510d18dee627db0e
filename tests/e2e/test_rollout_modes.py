"""Rollout overlapping training (train.rollout_mode, docs/algorithm.md §7b) through the real loop."""

import dataclasses

import pytest
import torch

from hacrl_megatron.agents.batch import LogProbOutput, MiniBatchInfo
from hacrl_megatron.algo import LossInputs, build_algorithm
from hacrl_megatron.config import ConfigError, HACPOConfig, load_config, validate
from hacrl_megatron.trainer import loop
from tests.e2e.test_trainer import exported, run_with, split_run, tiny_exp


def mode_exp(path, mode, backend="hf", steps=4, **train):
    exp = tiny_exp(path, backend=backend, steps=steps)
    return validate(dataclasses.replace(exp, train=dataclasses.replace(exp.train, rollout_mode=mode, **train)))


def close(run):
    run.source.close()
    for rt in run.runtimes:
        rt.close()


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_one_step_off_trains_on_batches_exactly_one_version_behind(tmp_path, backend):
    run, history = run_with(mode_exp(tmp_path, "one_step_off", backend))
    before = {rt.name: exported(rt) for rt in run.runtimes}
    for step, metrics in enumerate(history):
        for name in ("llama", "qwen3"):
            assert metrics[f"{name}/staleness"] == (0.0 if step == 0 else 1.0)
            assert torch.isfinite(torch.tensor(metrics[f"{name}/hacpo/loss"]))
            if step:  # a stale batch: its self samples are weighted by min(1, π_prox/π_behav) ≤ 1
                assert 0.0 < metrics[f"{name}/hacpo/behaviour_weight_mean"] <= 1.0
                assert 0.0 <= metrics[f"{name}/hacpo/behaviour_truncfrac"] <= 1.0
            else:
                assert f"{name}/hacpo/behaviour_weight_mean" not in metrics
    assert before["llama"]  # weights exported after training
    close(run)


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_a_fresh_batch_trains_exactly_as_the_synchronous_loop(tmp_path, backend):
    """Staleness 0 (the first step of an overlapping run) is the synchronous loop, loss for loss."""
    _, sync = run_with(mode_exp(tmp_path / "sync", "sync", backend, steps=1))
    run, off = run_with(mode_exp(tmp_path / "off", "one_step_off", backend, steps=1))
    for key, value in sync[0].items():
        # the engines' token counters already include the next batch, sampled while this step trained
        if not key.startswith(("time/", "rollout/")) and "_per_s" not in key and "peak_" not in key \
                and "/trainer/" not in key and "rollout_tokens" not in key:
            assert off[0][key] == value, key
    close(run)


def test_behaviour_equal_to_the_proximal_policy_changes_nothing():
    """§7b at staleness 0 by construction: π_behav = π_prox gives weight 1 on self rows and the same
    cross ratio, so loss, gradient and metrics equal the plain loss exactly."""
    cfg = HACPOConfig()
    flat = torch.tensor([-0.5, -0.7, -0.2, -0.4, -1.0, -0.6], dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 2, 4, 6])
    out = LogProbOutput(token_logps=flat, cu_seqlens=cu, seq_logp_sum=torch.stack([flat[0:2].sum(), flat[2:4].sum(),
                        flat[4:6].sum()]), seq_len=torch.tensor([2, 2, 2]))
    base = dict(advantages=torch.tensor([1.0, -0.5, 0.8], dtype=torch.float64), is_self=torch.tensor([True, True, False]),
                discrepancy=torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64),
                source_logp_sum=torch.tensor([-1.1, -0.5, -1.9], dtype=torch.float64), source_len=torch.tensor([2, 2, 3]))
    loss_fn = build_algorithm(cfg, 2).loss_fn(["a", "b"])
    info = MiniBatchInfo(1, 3, 6)
    plain, plain_metrics = loss_fn(out, LossInputs(**base), info)
    (plain_grad,) = torch.autograd.grad(plain, flat)
    fresh, fresh_metrics = loss_fn(out, LossInputs(**base, behaviour_log_ratio=torch.zeros(3, dtype=torch.float64)),
                                   info)
    (fresh_grad,) = torch.autograd.grad(fresh, flat)
    assert float(fresh) == float(plain)
    assert torch.equal(fresh_grad, plain_grad)
    assert {k: v for k, v in fresh_metrics.items() if not k.startswith("behaviour_")} == plain_metrics
    assert fresh_metrics["behaviour_weight_mean"] == 1.0 and fresh_metrics["behaviour_truncfrac"] == 0.0
    # a stale self row with π_prox > π_behav (b > 0) is truncated to 1; b < 0 scales its term by e^b
    stale, metrics = loss_fn(out, LossInputs(**base, behaviour_log_ratio=torch.tensor([0.3, -0.2, 0.0],
                                                                                     dtype=torch.float64)), info)
    assert metrics["behaviour_truncfrac"] == 0.5
    assert metrics["behaviour_weight_mean"] == pytest.approx((1.0 + torch.exp(torch.tensor(-0.2)).item()) / 2)
    assert float(stale) != float(plain)


def test_async_respects_the_staleness_bound(tmp_path):
    run, history = run_with(mode_exp(tmp_path, "async", steps=5, max_staleness=2))
    for metrics in history:
        for name in ("llama", "qwen3"):
            assert 0.0 <= metrics[f"{name}/staleness"] <= 2.0
        assert metrics["rollout/dropped_batches"] >= 0.0
    assert history[0]["llama/staleness"] == 0.0  # the first batch comes from the starting weights
    close(run)


def test_async_drops_and_counts_batches_beyond_the_bound(tmp_path):
    """A batch queued while the weights moved on by more than K versions is not trained on. (The HF
    engines here compute in this process, so the producer fills its queue in the loop's thread: K + 1
    batches of the current weights, the oldest handed out.)"""
    run, _ = run_with(mode_exp(tmp_path, "async", steps=4, max_staleness=1), steps=0)  # batches 0-3 exist
    source = run.source
    first = source.next(0)
    assert first.index == 0 and [r.index for r in source.pending()] == [1]  # batch 1: version 0, queued
    run.step = run.weights_version = 3  # three updates and weight pushes later: batch 1 is 3 versions old
    later = source.next(3)
    assert source.stats.dropped == 1 and later.index == 2 and later.staleness(3) == 0
    close(run)


def test_async_inline_trains_k_versions_behind(tmp_path):
    run, history = run_with(mode_exp(tmp_path, "async", steps=4, max_staleness=2))
    assert [m["llama/staleness"] for m in history] == [0.0, 1.0, 2.0, 2.0]
    assert all(m["rollout/dropped_batches"] == 0.0 for m in history)
    close(run)


def test_one_step_off_resumes_exactly_with_a_batch_in_flight(tmp_path):
    """The checkpoint after step 2 holds step 2's batch (sampled with step 1's weights, its behaviour
    log-probs filled in); the resumed run trains steps 2-3 exactly as the unbroken one."""
    full_exp = mode_exp(tmp_path / "full", "one_step_off", "megatron")
    run, full = run_with(full_exp)
    close(run)
    first, _, later = split_run(mode_exp(tmp_path / "split", "one_step_off", "megatron"))
    for a, b in zip(full[2:], later, strict=True):
        for key in ("llama/hacpo/loss", "qwen3/hacpo/loss", "llama/hacpo/behaviour_weight_mean", "qwen3/staleness",
                    "llama/reward_mean", "llama/hacpo/grad_norm"):
            assert a[key] == b[key], key
    close(first)


@pytest.mark.parametrize("overrides, fragment", [
    (["train.rollout_mode=one_step_off", "rollout.engine=sglang", "rollout.colocate=true",
      "rollout.weight_sync=tensor"], "rollout.colocate=true time-shares"),
    (["train.rollout_mode=async", "hacpo.algorithm=grpo"], "hacpo.algorithm=grpo is token-level"),
    (["train.rollout_mode=later"], "train.rollout_mode='later': must be one of"),
    (["train.rollout_mode=async", "train.max_staleness=0"], "train.max_staleness"),
])
def test_overlap_refusals_name_both_keys(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("cpu_demo", overrides)
    assert fragment in str(err.value)


def test_sync_checkpoints_hold_no_batches_and_refuse_an_overlapping_ones(tmp_path):
    run, _ = run_with(mode_exp(tmp_path, "sync", steps=1))
    assert loop._rollout_state(run) == {"records": [], "next_index": None}
    with pytest.raises(ValueError, match="keeps no batches between steps"):
        run.source.restore([object()], 0)
    close(run)


def emulated(run, tokens_per_s=20_000.0):
    """Engines that only sleep (benchmarks/emulated_engine.py): they run 'elsewhere', so the producer
    gets a thread of its own and generation overlaps training for real. Returns the name of the thread
    that produced each batch."""
    import threading

    from benchmarks.emulated_engine import EmulatedEngine

    for rt in run.runtimes:
        rt.engine = EmulatedEngine(rt.engine, tokens_per_s)
    run.source.concurrent = True
    threads, produce = [], run.source._produce

    def recording(index):
        threads.append(threading.current_thread().name)
        return produce(index)

    run.source._produce = recording
    return threads


def threaded_run(exp, steps):
    run = loop.setup(exp)
    run.verifier.close()
    from hacrl_megatron.reward.pool import VerifierPool
    from tests.e2e.test_trainer import parity_reward

    run.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
    threads = emulated(run)
    return run, threads, [loop.train_step(run) for _ in range(steps)]


def test_one_step_off_generates_in_its_own_thread_and_resumes_exactly(tmp_path):
    exp = mode_exp(tmp_path / "full", "one_step_off", "megatron", steps=4)
    run, threads, full = threaded_run(exp, 4)
    assert threads[0] == "MainThread" and set(threads[1:]) == {"hacrl-rollout"}  # step 0's batch, then prefetches
    assert [m["qwen3/staleness"] for m in full] == [0.0, 1.0, 1.0, 1.0]
    close(run)
    split = mode_exp(tmp_path / "split", "one_step_off", "megatron", steps=4)
    split = dataclasses.replace(split, checkpoint=dataclasses.replace(split.checkpoint, every=2))
    first, _, _ = threaded_run(split, 2)
    loop._save(first)  # step 2's batch is finished (the push waited for it) and saved with its behaviour
    close(first)
    resumed = loop.setup(dataclasses.replace(split, checkpoint=dataclasses.replace(split.checkpoint, resume=True)))
    from hacrl_megatron.reward.pool import VerifierPool
    from tests.e2e.test_trainer import parity_reward

    resumed.verifier.close()
    resumed.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
    emulated(resumed)
    assert loop._resume(resumed) and resumed.step == 2
    later = [loop.train_step(resumed) for _ in range(2)]
    for a, b in zip(full[2:], later, strict=True):
        for key in ("llama/hacpo/loss", "qwen3/hacpo/loss", "llama/hacpo/behaviour_weight_mean", "llama/reward_mean"):
            assert a[key] == b[key], key
    close(resumed)


def test_the_wait_for_the_batch_in_flight_is_rollout_wait_not_sync(tmp_path):
    """Rollout slower than training: the loop waits for the prefetched batch before the push; that
    wait is ``rollout/wait_s`` and not part of ``time/sync_s``."""
    exp = mode_exp(tmp_path, "one_step_off", steps=3)
    run = loop.setup(exp)
    run.verifier.close()
    from hacrl_megatron.reward.pool import VerifierPool
    from tests.e2e.test_trainer import parity_reward

    run.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
    emulated(run, tokens_per_s=100.0)  # 4 prompts x 4 samples x 8 tokens: about 1.3 s per batch
    history = [loop.train_step(run) for _ in range(3)]
    close(run)
    for m in history[:2]:  # steps that prefetch: the batch in flight outlasts training
        assert m["rollout/wait_s"] > 0.3 and m["time/sync_s"] < m["rollout/wait_s"], m
    assert history[2]["rollout/wait_s"] < 0.3  # the last step prefetches nothing, so waits for nothing
