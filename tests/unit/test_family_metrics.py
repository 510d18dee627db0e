"""The per-family training metrics (docs/algorithm.md §10b): clip fractions of a learner's cross samples split by
the problem family of their prompt, the sign of A and the side of the window; the family's share of the cross
gradient; the per-family reward beside ω. Hand-built sequences, hand-computed values (fractions of a few
sequences and norms of small integers: exact in float64)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hacrl_megatron.algo import hacpo_metrics, hacpo_sequence_objective, name_pair_metrics
from hacrl_megatron.algo.hacpo import cross_grad_share, cross_grad_shares
from hacrl_megatron.config import HACPOConfig
from hacrl_megatron.data.records import PromptRecord
from hacrl_megatron.data.tasks import make_task
from hacrl_megatron.trainer import stages

# learner k = 0, one source j = 1; families 0 and 1 of a two-family task
#        self f0  self f1  cross f0 A>0 above  cross f0 A>0 inside  cross f0 A<0 below  cross f1 A<0 above
RATIO = [1.0, 1.5, 1.3, 0.9, 0.5, 1.2]
ADV = [1.0, 2.0, 1.0, 1.0, -1.0, -1.0]
IS_SELF = [True, True, False, False, False, False]
FAMILY = [0, 1, 0, 0, 0, 1]


def metrics_of(mode: str, family=FAMILY) -> dict[str, float]:
    cfg = dataclasses.replace(HACPOConfig(), cross_clip_mode=mode)
    return hacpo_metrics(torch.tensor(RATIO, dtype=torch.float64).log(), torch.tensor(ADV), torch.tensor(IS_SELF),
                         update_index=0, cfg=cfg, source_index=torch.tensor([0, 0, 1, 1, 1, 1]),
                         family_index=None if family is None else torch.tensor(family))


def family_keys(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("family/") and "median" not in k}


def test_clamp_window_clips_by_family_sign_and_side():
    # §5 clamp on [0.8, 1]: 1.3 (A > 0) and 1.2 (A < 0) above, 0.5 below, 0.9 inside; GSPO's self window
    # [1 − 3e-4, 1 + 4e-4] clips the A > 0 self row at 1.5 (family 1), not the one at 1.0 (family 0)
    assert family_keys(metrics_of("clamp")) == {
        "family/0/self_clipfrac": 0.0,
        "family/0/cross_clipfrac/1/pos": 0.5, "family/0/cross_clipfrac/1/pos/above": 0.5,
        "family/0/cross_clipfrac/1/pos/below": 0.0,
        "family/0/cross_clipfrac/1/neg": 1.0, "family/0/cross_clipfrac/1/neg/above": 0.0,
        "family/0/cross_clipfrac/1/neg/below": 1.0,
        "family/1/self_clipfrac": 1.0,
        # no A > 0 cross row of family 1: no pos keys (not a 0 that would dilute the means over micro-batches)
        "family/1/cross_clipfrac/1/neg": 1.0, "family/1/cross_clipfrac/1/neg/above": 1.0,
        "family/1/cross_clipfrac/1/neg/below": 0.0,
    }


def test_bounded_window_keeps_the_gradient_of_a_negative_sample_above_it():
    # §5a pessimistic: min(s·A, s_c·A) has a gradient for A < 0 above the window (the bound is s·A there)
    got = family_keys(metrics_of("pessimistic"))
    assert got["family/1/cross_clipfrac/1/neg"] == 0.0 and got["family/1/cross_clipfrac/1/neg/above"] == 0.0
    assert got["family/0/cross_clipfrac/1/neg/below"] == 1.0 and got["family/0/cross_clipfrac/1/pos/above"] == 0.5


def test_medians_of_each_family_and_the_split_sums_to_the_sign():
    got = metrics_of("clamp")
    assert got["family/0/cross_log_ratio_median/1"] == pytest.approx(math.log(0.9), abs=1e-15)  # middle of three
    assert got["family/1/cross_log_ratio_median/1"] == pytest.approx(math.log(1.2), abs=1e-15)  # the one row
    for key, value in got.items():
        if key.startswith("family/") and key.endswith(("/pos", "/neg")):
            assert got[f"{key}/above"] + got[f"{key}/below"] == value, key


def test_without_families_or_outside_them_nothing_is_added():
    plain = metrics_of("clamp", family=None)
    assert not family_keys(plain)
    assert metrics_of("clamp")["cross_clipfrac/1/pos"] == plain["cross_clipfrac/1/pos"] == 0.5
    outside = metrics_of("clamp", family=[-1, -1, 1, 1, 1, 1])  # −1: a prompt of no family
    assert {k.split("/")[1] for k in family_keys(outside)} == {"1"}
    assert outside["family/1/cross_clipfrac/1/pos"] == 0.5


def test_gspo_has_no_cross_rows_only_each_familys_self_clipfrac():
    cfg = dataclasses.replace(HACPOConfig(), algorithm="gspo")
    got = hacpo_metrics(torch.tensor(RATIO, dtype=torch.float64).log(), torch.tensor(ADV), torch.tensor(IS_SELF), 0,
                        cfg, source_index=torch.tensor([0, 0, 1, 1, 1, 1]), family_index=torch.tensor(FAMILY))
    # every row under GSPO's clip (PPO's bound): family 0 clips 1.3 (A > 0) and 0.5 (A < 0) of four; family 1
    # clips 1.5 (A > 0), not 1.2 (A < 0 above the window keeps its gradient)
    assert family_keys(got) == {"family/0/self_clipfrac": 0.5, "family/1/self_clipfrac": 0.5}


def test_cross_grad_share_within_each_family():
    # s = 1 everywhere (inside both windows), α's factor sg[s_c]^α = 1, ω = 1: ∂J/∂ℓ = s·A = A per row
    adv = torch.tensor([3.0, 1.0, 4.0, 0.0, 2.0])
    is_self = torch.tensor([True, True, False, False, False])
    family = torch.tensor([0, 1, 0, 1, -1])
    log_ratio = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    cfg = HACPOConfig()
    objective = hacpo_sequence_objective(log_ratio, adv, is_self, torch.ones(5), 0, cfg)
    got = cross_grad_shares(objective, log_ratio, is_self, family)
    assert got["family/0/cross_grad_share"] == 0.8  # ‖(4)‖ / ‖(3, 4)‖
    assert got["family/1/cross_grad_share"] == 0.0  # the cross row has A = 0
    assert got["cross_grad_share"] == pytest.approx(math.sqrt(20 / 30), rel=1e-15)  # ‖(4, 0, 2)‖ / ‖(3, 1, 4, 0, 2)‖
    assert got["cross_grad_share"] == cross_grad_share(objective, log_ratio, is_self)
    assert set(got) == {"cross_grad_share", "family/0/cross_grad_share", "family/1/cross_grad_share"}
    assert cross_grad_shares(objective.detach(), log_ratio.detach(), is_self, family) == {}  # no graph


def test_family_and_pair_keys_get_names():
    metrics = {"family/1/cross_clipfrac/0/pos/above": 0.25, "family/0/self_clipfrac": 0.5,
               "family/0/cross_log_ratio_median/1": -0.2, "cross_clipfrac/1/neg": 0.1}
    assert name_pair_metrics(metrics, ["adder", "subtractor"], ("add", "sub")) == {
        "family/sub/cross_clipfrac/adder/pos/above": 0.25, "family/add/self_clipfrac": 0.5,
        "family/add/cross_log_ratio_median/subtractor": -0.2, "cross_clipfrac/subtractor/neg": 0.1}
    with pytest.raises(ValueError, match=r"family/2/self_clipfrac: family index 2 .*\['add', 'sub'\]"):
        name_pair_metrics({"family/2/self_clipfrac": 0.0}, ["adder", "subtractor"], ("add", "sub"))


def test_prompt_family_index_and_the_reward_per_family():
    task = make_task("add_sub_cot", difficulty=2, seed=0)
    prompts = [PromptRecord(id=str(i), question=q, answer="0", source="add_sub_cot", kind="integer") for i, q in enumerate(["12+30=?", "52-17=?", "9+9=?"])]
    index = stages.prompt_family_index(task, prompts)
    assert index.tolist() == [0, 1, 0] and index.dtype == torch.long
    assert stages.prompt_family_index(make_task("addition", difficulty=1, seed=0), prompts) is None
    rewards = torch.tensor([[[1.0, 0.0], [1.0, 1.0]], [[0.0, 0.0], [1.0, 0.0]], [[1.0, 1.0], [0.0, 0.0]]])  # [P, n, G]
    data = stages.StepData(prompts=prompts, trajectories={"a": [], "b": []}, rewards=rewards)
    agents = [type("A", (), {"name": n, "index": i})() for i, n in enumerate("ab")]
    got = stages.reward_metrics(data, agents, index, task.families)
    assert got["a/reward/add/mean"] == 0.75 and got["a/reward/sub/mean"] == 0.0
    assert got["b/reward/add/mean"] == 0.5 and got["b/reward/sub/mean"] == 0.5
    assert "a/reward/add/mean" not in stages.reward_metrics(data, agents)


def test_the_family_table_tool_averages_only_the_steps_that_logged_a_key(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("family_metrics", Path(__file__).parents[2] / "benchmarks" /
                                                  "family_metrics.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    pos = "a/hacpo/family/sub/cross_clipfrac/b/pos"
    rows = [{"step": 0, "a/eval_accuracy": 0.5},  # the evaluation before training: no loss, not a step
            {"step": 1, "a/hacpo/loss": 1.0, pos: 0.25, "a/reward/sub/mean": 0.5,
             "a/hacpo/family/sub/cross_log_ratio_median/b": -0.5},
            {"step": 2, "a/hacpo/loss": 1.0, "a/reward/sub/mean": 1.0,  # no A > 0 cross row of sub this step
             "a/hacpo/family/sub/cross_log_ratio_median/b": -0.25}]
    run = tmp_path / "run with space"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert tool.main([str(run), "--json", str(tmp_path / "out.json")]) == 0
    stats = json.loads((tmp_path / "out.json").read_text())[str(run)]
    assert stats[pos] == {"mean": 0.25, "first5": 0.25, "last5": 0.25, "steps": 1}
    assert stats["a/reward/sub/mean"]["mean"] == 0.75 and stats["a/reward/sub/mean"]["steps"] == 2
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| a ← b | sub |"))
    assert line.split(" | ")[2:4] == ["0.750", "0.250"] and "n/a" in line  # reward, clipped A>0; unlogged cells
    with pytest.raises(SystemExit, match=r"empty/metrics\.jsonl does not exist"):
        tool.main([str(tmp_path / "empty")])
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "a/hacpo/loss": 1.0}) + "\n")
    with pytest.raises(SystemExit, match="logs no per-family metric"):
        tool.main([str(run)])
