"""The planner's step time follows the loop's schedule: every stage (rollout, verify, π_old, train,
sync) runs for all agents at once and waits for the slowest, the stages one after another. The
previous loop's schedule (agents one after another outside training) and the overlapped modes are
printed next to it; the issue's hand computation from the planner's own per-agent numbers is
reproduced here."""

from __future__ import annotations

from argparse import Namespace

import pytest

from hacrl_megatron.plan.timing import (
    STAGES,
    Assumptions,
    Tokens,
    overlapped_step_seconds,
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
def paper() -> dict:
    return _plan("paper_qwen3_4b_with_instruct", 1)


A = {"rollout_s": 100.0, "old_logprob_s": 10.0, "train_s": 50.0, "sync_s": 2.0}
B = {"rollout_s": 60.0, "old_logprob_s": 30.0, "train_s": 40.0, "sync_s": 5.0}


def test_schedule_formulas_by_hand():
    step = step_seconds([A, B], verify_s=3.0)
    assert step == {"rollout_s": 100.0, "verify_s": 3.0, "old_logprob_s": 30.0, "train_s": 50.0, "sync_s": 5.0,
                    "total_s": 188.0}
    # the previous loop: rollout, π_old and sync summed over agents, training concurrent
    assert sequential_step_seconds([A, B], 3.0) == 160.0 + 3.0 + 40.0 + 50.0 + 7.0
    # one-step-off / async: rollout (100) against the rest (3 + 30 + 50 + 5 = 88)
    assert overlapped_step_seconds(step) == 100.0
    assert overlapped_step_seconds(step_seconds([{**A, "rollout_s": 20.0}, {**B, "rollout_s": 20.0}], 3.0)) == 88.0
    # one agent: every schedule is the sum of its stages
    one = step_seconds([A], 0.0)
    assert one["total_s"] == sequential_step_seconds([A], 0.0) == 162.0


def test_verify_cost_is_per_response_over_workers():
    tok = Tokens(prompts=128, samples=8, agents=2, prompt_len=1024, max_response_len=4096, updates=4, micro_batch=1)
    a = Assumptions(verify_ms_per_response=10.0)
    assert verify_seconds(tok, 16, a) == pytest.approx(2048 * 0.010 / 16)
    assert verify_seconds(tok, 0, a) == pytest.approx(2048 * 0.010)  # in-process: one at a time


def test_70b_step_is_the_sum_of_stage_maxima(plan70b):
    times = [a["time_s"] for a in plan70b["agents"]]
    stages = plan70b["step_stages_s"]
    for k in STAGES:
        if k != "verify_s":
            assert stages[k] == pytest.approx(max(t[k] for t in times), abs=0.01), k
    assert plan70b["step_time_s"] == pytest.approx(sum(stages.values()), abs=0.02)
    assert plan70b["step_time_s"] == pytest.approx(1372.0, abs=0.5)  # README's Scaling table
    rest = stages["verify_s"] + stages["old_logprob_s"] + stages["train_s"] + stages["sync_s"]
    assert plan70b["step_time_one_step_off_s"] == plan70b["step_time_async_s"] == \
        pytest.approx(max(stages["rollout_s"], rest), abs=0.01)
    assert plan70b["step_time_one_step_off_s"] == pytest.approx(988.8, abs=0.5)  # rollout-bound


def test_70b_previous_schedule_reproduces_the_issue(plan70b):
    """The issue's figure: rollout and sync summed over agents, π_old + training taken with the
    slower agent (as the old planner bundled them): ~2,325 s against the 1,371 s it printed. The
    old loop also ran the π_old passes one agent after another: 2,421 s."""
    t = [a["time_s"] for a in plan70b["agents"]]
    issue = (sum(x["rollout_s"] for x in t) + max(x["old_logprob_s"] + x["train_s"] for x in t)
             + sum(x["sync_s"] for x in t))
    assert issue == pytest.approx(2325, abs=1)
    old_printed = max(x["rollout_s"] for x in t) + max(x["old_logprob_s"] + x["train_s"] for x in t) + \
        max(x["sync_s"] for x in t)
    assert old_printed == pytest.approx(1371, abs=1)
    stages = plan70b["step_stages_s"]
    assert plan70b["step_time_sequential_s"] == pytest.approx(
        sum(x[k] for x in t for k in ("rollout_s", "old_logprob_s", "sync_s")) + stages["verify_s"]
        + max(x["train_s"] for x in t), abs=0.02)
    assert plan70b["step_time_sequential_s"] == pytest.approx(2420.8, abs=0.5)


def test_paper_preset_schedules(paper):
    t = [a["time_s"] for a in paper["agents"]]
    issue = sum(x["rollout_s"] for x in t) + max(x["old_logprob_s"] + x["train_s"] for x in t) + \
        sum(x["sync_s"] for x in t)
    assert issue == pytest.approx(413, abs=1)  # the issue's figure for the paper preset
    assert paper["step_time_s"] == pytest.approx(300.8, abs=0.5)
    assert paper["step_time_sequential_s"] == pytest.approx(452.3, abs=0.5)
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
    assert "step estimate: 1372.0 s = rollout 988.8 + verify 1.3 + pi_old 97.5 + train 278.6 + sync 5.8" in out
    assert "previous loop (rollout, pi_old and sync one agent after another): 2420.8 s" in out
    assert "rollout overlapped (train.rollout_mode one_step_off / async): 988.8 s per step" in out
    assert "llama70b: trainer on node 1 GPUs 0-7, node 2 GPUs 0-7, node 3 GPUs 0-7, node 4 GPUs 0-7; engines: " \
           "node 0 GPUs 0-3" in out
