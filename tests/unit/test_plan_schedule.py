"""The planner's step time follows the loop's schedule: every stage (rollout, verify, re-tokenise,
π_old, train, sync) runs for all agents at once and waits for the slowest, the stages one after
another. The previous loop's schedule (agents one after another outside training) and the
overlapped modes are printed next to it. π_old counts the sequences the loop scores for the
configured method (own responses under clamp, all under decoupled, plus the KL's reference pass)."""

from __future__ import annotations

from argparse import Namespace

import pytest

from hacrl_megatron.plan.timing import (
    STAGES,
    Assumptions,
    Tokens,
    overlapped_step_seconds,
    separate_jobs_seconds,
    sequential_step_seconds,
    step_seconds,
    verify_seconds,
)

H100 = 80e9 / 2**30


def _plan(preset: str, nodes: int, **kw) -> dict:
    from hacrl_megatron.plan.cli import _experiment

    args = Namespace(preset=preset, overrides=[], nodes=nodes, gpus_per_node=8, gpu_memory_gib=H100, gpu="h100")
    for k, v in kw.items():
        setattr(args, k, v)
    return _experiment(args)


@pytest.fixture(scope="module")
def plan70b() -> dict:
    return _plan("multinode_llama70b_qwen72b", 9)


@pytest.fixture(scope="module")
def plan70b_decoupled() -> dict:
    return _plan("multinode_llama70b_qwen72b", 9, overrides=["hacpo.cross_clip_mode=decoupled"])


@pytest.fixture(scope="module")
def paper() -> dict:
    return _plan("paper_qwen3_4b_with_instruct", 1)


A = {"rollout_s": 100.0, "old_logprob_s": 10.0, "train_s": 50.0, "sync_s": 2.0}
B = {"rollout_s": 60.0, "old_logprob_s": 30.0, "train_s": 40.0, "sync_s": 5.0}


def test_schedule_formulas_by_hand():
    step = step_seconds([A, B], verify_s=3.0)
    assert step == {"rollout_s": 100.0, "verify_s": 3.0, "retokenize_s": 0.0, "old_logprob_s": 30.0,
                    "train_s": 50.0, "sync_s": 5.0, "total_s": 188.0}
    # the controller's re-tokenisation is one stage for all agents, on the rest side of an overlapped step
    with_retok = step_seconds([A, B], 3.0, 7.0)
    assert with_retok["total_s"] == 195.0 and overlapped_step_seconds(with_retok) == 100.0
    assert sequential_step_seconds([A, B], 3.0, 7.0) == 160.0 + 3.0 + 7.0 + 40.0 + 50.0 + 7.0
    # the previous loop: rollout, π_old and sync summed over agents, training concurrent
    assert sequential_step_seconds([A, B], 3.0) == 160.0 + 3.0 + 40.0 + 50.0 + 7.0
    # one-step-off / async: rollout (100) against the rest (3 + 30 + 50 + 5 = 88)
    assert overlapped_step_seconds(step) == 100.0
    assert overlapped_step_seconds(step_seconds([{**A, "rollout_s": 20.0}, {**B, "rollout_s": 20.0}], 3.0)) == 88.0
    # one agent: every schedule is the sum of its stages
    one = step_seconds([A], 0.0)
    assert one["total_s"] == sequential_step_seconds([A], 0.0) == 162.0


def test_separate_jobs_by_hand():
    """Each agent as its own job: its own stages plus its share (1/n) of the controller's verify and
    re-tokenisation; every job advances at the slowest job's pace (steady state) and waits the difference."""
    jobs = separate_jobs_seconds({"a": A, "b": B}, verify_s=4.0, retokenize_s=6.0)
    # a: 100 + 10 + 50 + 2 + (4 + 6) / 2 = 167; b: 60 + 30 + 40 + 5 + 5 = 140
    assert jobs == {"a": {"own_s": 167.0, "barrier_wait_s": 0.0, "step_s": 167.0},
                    "b": {"own_s": 140.0, "barrier_wait_s": 27.0, "step_s": 167.0}}
    # below the one-process step (every stage at its slowest agent's time: 100 + 4 + 6 + 30 + 50 + 5 = 195)
    assert step_seconds([A, B], 4.0, 6.0)["total_s"] == 195.0
    assert separate_jobs_seconds({"a": A}, 4.0) == {"a": {"own_s": 166.0, "barrier_wait_s": 0.0, "step_s": 166.0}}


def test_70b_separate_jobs(plan70b):
    jobs = plan70b["step_separate_jobs_s"]
    assert sorted(jobs) == ["llama70b", "qwen72b"]
    slowest = max(j["own_s"] for j in jobs.values())
    for job in jobs.values():
        assert job["step_s"] == pytest.approx(slowest, abs=0.01)
        assert job["barrier_wait_s"] == pytest.approx(slowest - job["own_s"], abs=0.02)
    assert slowest <= plan70b["step_time_s"]


def test_verify_cost_is_per_response_over_workers():
    tok = Tokens(prompts=128, samples=8, agents=2, prompt_len=1024, max_response_len=4096, updates=4, micro_batch=1)
    a = Assumptions(verify_ms_per_response=10.0)
    assert verify_seconds(tok, 16, a) == pytest.approx(2048 * 0.010 / 16)
    assert verify_seconds(tok, 0, a) == pytest.approx(2048 * 0.010)  # in-process: one at a time


def test_70b_step_is_the_sum_of_stage_maxima(plan70b):
    times = [a["time_s"] for a in plan70b["agents"]]
    stages = plan70b["step_stages_s"]
    for k in STAGES:
        if k not in ("verify_s", "retokenize_s"):
            assert stages[k] == pytest.approx(max(t[k] for t in times), abs=0.01), k
    assert plan70b["step_time_s"] == pytest.approx(sum(stages.values()), abs=0.02)
    assert plan70b["step_time_s"] == pytest.approx(1355.4, abs=0.5)  # docs/scaling.md's table
    rest = sum(v for k, v in stages.items() if k != "rollout_s")
    assert plan70b["step_time_one_step_off_s"] == plan70b["step_time_async_s"] == \
        pytest.approx(max(stages["rollout_s"], rest), abs=0.01)
    assert plan70b["step_time_one_step_off_s"] == pytest.approx(988.8, abs=0.5)  # rollout-bound


def test_70b_previous_schedule(plan70b):
    t = [a["time_s"] for a in plan70b["agents"]]
    stages = plan70b["step_stages_s"]
    assert plan70b["step_time_sequential_s"] == pytest.approx(
        sum(x[k] for x in t for k in ("rollout_s", "old_logprob_s", "sync_s")) + stages["verify_s"]
        + stages["retokenize_s"] + max(x["train_s"] for x in t), abs=0.02)
    assert plan70b["step_time_sequential_s"] == pytest.approx(2357.4, abs=0.5)


def test_70b_pi_old_counts_what_the_loop_scores(plan70b, plan70b_decoupled):
    """clamp: each agent scores its own B·G = 1024 responses; decoupled: also the other agent's
    (the learner's own π_old on them), n·B·G = 2048: the stage is n = 2 times as long, the layout
    the same. Re-tokenisation doubles too (the π_old pass re-encodes the cross responses again)."""
    for clamp, dec in zip(plan70b["agents"], plan70b_decoupled["agents"]):
        assert clamp["layout"] == dec["layout"]
        assert (clamp["time_s"]["old_logprob_sequences"], dec["time_s"]["old_logprob_sequences"]) == (1024, 2048)
        assert dec["time_s"]["old_logprob_s"] == pytest.approx(2 * clamp["time_s"]["old_logprob_s"], abs=0.002)  # 3 decimals
    a, b = plan70b["step_stages_s"], plan70b_decoupled["step_stages_s"]
    assert b["old_logprob_s"] == pytest.approx(2 * a["old_logprob_s"], abs=0.02)
    # 2 learners × 1024 cross responses × 2048 mean response tokens × 7.5 µs
    assert a["retokenize_s"] == pytest.approx(2 * 1024 * 2048 * 7.5e-6, abs=0.01)
    assert b["retokenize_s"] == pytest.approx(2 * a["retokenize_s"], abs=0.02)  # both rounded to 0.01


def test_70b_run_terms(plan70b):
    """Checkpoint: 14 B per parameter of both agents written once at 2 GB/s (hashed as written, nothing
    read back); 58 steps every 5 = 12 checkpoints (the last step included); export: bf16 once. The
    asynchronous save (the default on GPUs) holds the loop for the largest rank's copy to host memory
    only: well under 10% of a step; the run adds the last save's write, finished at its end."""
    params = sum(a["params"]["hf_total"] for a in plan70b["agents"])
    assert plan70b["checkpoint_s"] == pytest.approx(14 * params / 2e9, abs=0.01)
    assert plan70b["checkpoints"] == 12
    assert plan70b["export_s"] == pytest.approx(2 * params / 2e9, abs=0.01)
    largest = max(max(a["params_per_stage"]) for a in plan70b["agents"])
    assert plan70b["checkpoint_async"] is True
    assert plan70b["checkpoint_wait_s"] == plan70b["checkpoint_snapshot_s"] == pytest.approx(14 * largest / 10e9, abs=0.01)
    assert plan70b["checkpoint_wait_s"] < 0.1 * plan70b["step_time_s"]
    assert plan70b["checkpoint_host_gib"] == pytest.approx(8 * 14 * largest / 2**30, abs=0.01)
    assert plan70b["run_time_s"] == pytest.approx(58 * plan70b["step_time_s"] + 12 * plan70b["checkpoint_wait_s"]
                                                  + plan70b["checkpoint_s"] + plan70b["export_s"], abs=1)
    for a in plan70b["agents"]:  # the post-sync probe is part of the sync stage
        t = a["time_s"]
        assert 0 < t["probe_s"] < 1 and t["sync_s"] == pytest.approx(t["sync_transfer_s"] + t["probe_s"], abs=0.002)


def test_70b_synchronous_checkpoints_hold_the_loop_for_the_whole_write():
    sync = _plan("multinode_llama70b_qwen72b", 9, overrides=["checkpoint.async_save=false"])
    assert sync["checkpoint_async"] is False
    assert sync["checkpoint_wait_s"] == pytest.approx(sync["checkpoint_snapshot_s"] + sync["checkpoint_s"], abs=0.02)
    assert sync["checkpoint_wait_s"] > 0.5 * sync["step_time_s"]
    assert sync["run_time_s"] == pytest.approx(58 * sync["step_time_s"] + 12 * sync["checkpoint_wait_s"]
                                               + sync["export_s"], abs=1)


def test_an_async_save_waits_for_the_part_of_the_previous_write_the_steps_did_not_cover():
    from hacrl_megatron.plan.timing import checkpoint_wait_seconds

    assert checkpoint_wait_seconds(100.0, 2.0, 30.0, asynchronous=True) == 72.0
    assert checkpoint_wait_seconds(100.0, 2.0, 300.0, asynchronous=True) == 2.0
    assert checkpoint_wait_seconds(100.0, 2.0, 300.0, asynchronous=False) == 102.0


def test_paper_preset_schedules(paper):
    # Qwen3-4B and its instruct model share one vocabulary: nothing is re-tokenised
    assert paper["step_stages_s"]["retokenize_s"] == 0.0
    assert paper["step_time_s"] == pytest.approx(300.9, abs=0.5)
    assert paper["step_time_sequential_s"] == pytest.approx(452.5, abs=0.5)
    # colocated engines cannot overlap: the overlapped figure comes from a plan with separate engines
    assert paper["placement"]["colocated"]
    alt = paper["overlap_plan"]
    assert paper["step_time_one_step_off_s"] == alt["step_time_s"] == pytest.approx(368.7, abs=0.5)
    assert not alt["placement"]["colocated"]
    assert [(x["trainer_gpus"], x["engine_gpus"]) for x in alt["layouts"]] == [(2, 2), (2, 2)]
    assert "rollout.colocate=false" in alt["overrides"]


def test_text_output_names_every_schedule(capsys):
    from hacrl_megatron.cli import main

    assert main(["plan", "--preset", "multinode_llama70b_qwen72b", "--nodes", "9", "--gpus-per-node", "8",
                 "--gpu-memory-gib", "74.5"]) == 0
    out = capsys.readouterr().out
    assert ("step estimate: 1355.4 s = rollout 988.8 + verify 1.3 + re-tokenise 31.5 + pi_old 48.7 + train 278.6 "
            "+ sync 6.5") in out
    assert ("run: 79802 s = steps + 12 checkpoint wait(s) of 3.5 s + the last checkpoint's write 1002.8 s + final "
            "export 143.3 s") in out
    assert "checkpoint: 1002.8 s to write (every agent at once, hashed as written); each save holds the loop 3.5 s" in out
    assert "previous loop (rollout, pi_old and sync one agent after another): 2357.4 s" in out
    assert "rollout overlapped (train.rollout_mode one_step_off / async): 988.8 s per step" in out
    assert "as separate jobs (hacrl train --agent, docs/exchange.md): llama70b " in out
    assert "llama70b: trainer on node 1 GPUs 0-7, node 2 GPUs 0-7, node 3 GPUs 0-7, node 4 GPUs 0-7; engines: " \
           "node 0 GPUs 0-3" in out


def _tokens(*overrides: str) -> Tokens:
    from hacrl_megatron.config import ExperimentConfig, apply_override, from_dict, read_preset, validate
    from hacrl_megatron.plan.experiment import step_tokens

    data = read_preset("multinode_llama70b_qwen72b")
    for ov in overrides:
        apply_override(data, ov)
    return step_tokens(validate(from_dict(ExperimentConfig, data)))


@pytest.mark.parametrize("overrides, old, trained, own", [
    ((), 1024, 2048, 1024),  # HACPO, clamp: own responses
    (("hacpo.cross_clip_mode=pessimistic",), 1024, 2048, 1024),
    (("hacpo.cross_clip_mode=decoupled",), 2048, 2048, 1024),  # + the other agent's, in the learner's tokens
    (("hacpo.kl_coef=0.01",), 2048, 2048, 1024),  # + the frozen reference over the own responses
    (("hacpo.cross_clip_mode=decoupled", "hacpo.kl_coef=0.01"), 3072, 2048, 1024),
    (("hacpo.algorithm=naive_merge",), 2048, 2048, 1024),
    (("hacpo.algorithm=gspo",), 1024, 1024, 1024),  # learns from its own responses only
    (("hacpo.algorithm=gspo_x2",), 2048, 2048, 2048),  # 2G per prompt
    (("hacpo.algorithm=grpo",), 1024, 1024, 1024),
])
def test_sequences_per_method(overrides, old, trained, own):
    """B = 128 prompts, G = 8, n = 2: the sequences each stage covers follow the method's passes."""
    tok = _tokens(*overrides)
    assert (tok.old_sequences, tok.trained_sequences, tok.own_sequences) == (old, trained, own)
    assert tok.step_responses == 2 * own  # the verifier scores every agent's responses


def test_pi_old_time_scales_with_its_sequences():
    """At a fixed layout the π_old stage is proportional to the sequences it scores (decoupled: n×)."""
    from hacrl_megatron.config import ExperimentConfig, from_dict, read_preset, validate
    from hacrl_megatron.plan.experiment import agent_spec
    from hacrl_megatron.plan.gpus import gpu_by_name
    from hacrl_megatron.plan.memory import Layout
    from hacrl_megatron.plan.timing import train_seconds

    cfg = validate(from_dict(ExperimentConfig, read_preset("multinode_llama70b_qwen72b")))
    spec, _ = agent_spec(cfg.agents[0])
    layout, gpu, a = Layout(4, 8, 1, True, "selective", True), gpu_by_name("h100"), Assumptions()
    clamp = train_seconds(spec, layout, gpu, _tokens(), a)
    dec = train_seconds(spec, layout, gpu, _tokens("hacpo.cross_clip_mode=decoupled"), a)
    kl = train_seconds(spec, layout, gpu, _tokens("hacpo.cross_clip_mode=decoupled", "hacpo.kl_coef=0.01"), a)
    assert dec["old_logprob_s"] == pytest.approx(2 * clamp["old_logprob_s"], rel=1e-12)
    assert kl["old_logprob_s"] == pytest.approx(3 * clamp["old_logprob_s"], rel=1e-12)
    assert dec["train_s"] == clamp["train_s"]  # training covers the same n·B·G sequences


def test_the_sync_term_states_its_assumed_bandwidth_and_the_measured_push(plan70b):
    from hacrl_megatron.plan.report import render_text
    from hacrl_megatron.plan.timing import MEASURED_SYNC_S_PER_GB

    sync = plan70b["assumptions"]["sync"]
    assert sync["bandwidth_gb_s"]["distributed"] == 25.0  # min(network 50, NVLink 450) GB/s x 0.5
    assert "network 50" in sync["bandwidth_source"]["distributed"] and "assumed" in sync["bandwidth_source"]["distributed"]
    assert sync["measured_s_per_gb"] == MEASURED_SYNC_S_PER_GB and "bench_weight_sync.py --stages" in sync["measured_source"]
    for agent in plan70b["agents"]:
        t = agent["time_s"]
        assert t["sync_bandwidth_gb_s"] == 25.0
        # the transfer is the bf16 HF weights over that bandwidth, nothing else
        assert t["sync_transfer_s"] == pytest.approx(agent["params"]["hf_total"] * 2 / 25e9, abs=1e-3)
    text = render_text(plan70b)
    assert "sync by distributed at 25 GB/s (assumed: min(network 50, NVLink 450) GB/s per GPU" in text
    assert (f"{MEASURED_SYNC_S_PER_GB['stages_gloo_cpu']:g} s/GB from every pipeline stage, "
            f"{MEASURED_SYNC_S_PER_GB['rank0_funnel_gloo_cpu']:g} s/GB through rank 0") in text
