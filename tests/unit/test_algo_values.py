"""Hand-computed values for every HACPO formula (docs/algorithm.md §1-5).

Worked example: n = 2 agents, P = 2 prompts, G = 4 samples.

    prompt 0: agent0 R = [1, 0, 0, 0], agent1 R = [1, 1, 1, 0]
    prompt 1: agent0 R = [1, 1, 1, 1], agent1 R = [1, 1, 1, 1]   (uniform → A = 0)

Capability after one step with P = [0.5, 0.8]:  ω^(0,1) = 0.5/0.8 = 0.625, ω^(1,0) = 1.6.

Learner 0, prompt 0:  r̃ = [1,0,0,0] + 0.625·[1,1,1,0]  →  μ = (1 + 1.875)/8 = 0.359375
Raw rewards [1,0,0,0,1,1,1,0]: mean 0.5, unbiased var = 8·0.25/7 = 2/7, σ = √(2/7) = 0.534522484
    A(R=1) = 0.640625/(σ+1e-6),  A(R=0) = −0.359375/(σ+1e-6)
Learner 1, prompt 0:  r̃ = 1.6·[1,0,0,0] + [1,1,1,0]  →  μ = 4.6/8 = 0.575
    A(R=1) = 0.425/(σ+1e-6),     A(R=0) = −0.575/(σ+1e-6)
"""

import math

import pytest
import torch

from hacrl_megatron.algo import (
    CapabilityTracker,
    capability_aware_advantages,
    capability_baseline,
    cross_window,
    grpo_token_loss,
    hacpo_loss,
    hacpo_sequence_objective,
    positive_rate,
    sequence_log_ratio,
)
from hacrl_megatron.config import HACPOConfig
from tests.unit.loss_inputs import from_log_ratio

REWARDS = torch.tensor(
    [
        [[1.0, 0, 0, 0], [1, 1, 1, 0]],
        [[1.0, 1, 1, 1], [1, 1, 1, 1]],
    ]
)
SIGMA = math.sqrt(2 / 7)


def tracker_with(*steps):
    tr = CapabilityTracker(len(steps[0]))
    for s in steps:
        tr.update(s)
    return tr


def test_capability_window_mean_includes_current_step():
    tr = CapabilityTracker(2, window=3)
    for rates in ([0.1, 0.9], [0.2, 0.8], [0.3, 0.7], [0.6, 0.4]):
        tr.update(rates)
    # window 3 keeps the last three steps: (0.2+0.3+0.6)/3, (0.8+0.7+0.4)/3
    torch.testing.assert_close(tr.capability(), torch.tensor([1.1 / 3, 1.9 / 3], dtype=torch.float64))


def test_capability_first_step_uses_current_only():
    tr = tracker_with([0.5, 0.8])
    torch.testing.assert_close(tr.capability(), torch.tensor([0.5, 0.8], dtype=torch.float64))
    omega = tr.omega()
    assert omega[0, 1].item() == pytest.approx(0.625)
    assert omega[1, 0].item() == pytest.approx(1.6)
    assert omega[0, 0].item() == 1.0 and omega[1, 1].item() == 1.0


def test_omega_clip_at_zero_capability():
    tr = tracker_with([0.0, 0.5])
    omega = tr.omega()
    assert omega[0, 1].item() == pytest.approx(0.1)  # 1e-8 / 0.5 clipped up to 0.1
    assert omega[1, 0].item() == pytest.approx(10.0)  # 0.5 / 1e-8 clipped down to 10
    both_zero = tracker_with([0.0, 0.0]).omega()
    torch.testing.assert_close(both_zero, torch.ones(2, 2, dtype=torch.float64))


def test_tracker_state_roundtrip_and_errors():
    tr = tracker_with([0.2, 0.4], [0.6, 0.8])
    other = CapabilityTracker(2)
    other.load_state_dict(tr.state_dict())
    torch.testing.assert_close(other.omega(), tr.omega())
    with pytest.raises(ValueError, match="num_agents"):
        CapabilityTracker(3).load_state_dict(tr.state_dict())
    with pytest.raises(ValueError, match="must lie in"):
        tr.update([1.5, 0.0])
    with pytest.raises(RuntimeError, match="before any update"):
        CapabilityTracker(2).capability()


def test_positive_rate_counts_reward_above_zero():
    assert positive_rate(torch.tensor([0.0, 0.5, 1.0, 0.0])) == 0.5
    assert positive_rate(torch.tensor([])) == 0.0


def test_advantages_hand_values_both_learners():
    omega = tracker_with([0.5, 0.8]).omega()
    denom = SIGMA + 1e-6
    a0 = capability_aware_advantages(REWARDS, 0, omega)
    expected_p0_l0 = torch.tensor([[0.640625, -0.359375, -0.359375, -0.359375],
                                   [0.640625, 0.640625, 0.640625, -0.359375]]) / denom
    torch.testing.assert_close(a0[0], expected_p0_l0)
    assert torch.equal(a0[1], torch.zeros(2, 4))  # uniform guard
    a1 = capability_aware_advantages(REWARDS, 1, omega)
    expected_p0_l1 = torch.tensor([[0.425, -0.575, -0.575, -0.575], [0.425, 0.425, 0.425, -0.575]]) / denom
    torch.testing.assert_close(a1[0], expected_p0_l1)


def test_advantages_plain_joint_mean_when_not_capability_aware():
    omega = tracker_with([0.5, 0.8]).omega()
    adv = capability_aware_advantages(REWARDS, 0, omega, capability_aware=False)
    expected = (REWARDS[0] - 0.5) / (SIGMA + 1e-6)
    torch.testing.assert_close(adv[0], expected)


def test_uniform_guard_switch():
    omega = tracker_with([0.5, 0.8]).omega()
    adv = capability_aware_advantages(REWARDS, 0, omega, uniform_guard=False)
    # prompt 1 all ones, μ = (4 + 0.625·4)/8 = 0.8125, σ = 0 → (1 − 0.8125)/1e-6
    torch.testing.assert_close(adv[1], torch.full((2, 4), 0.1875 / 1e-6))


def test_baseline_guard_falls_back_to_own_mean():
    omega = tracker_with([0.0, 0.5]).omega()  # ω^(1,0) = 10 after clipping
    rewards = torch.tensor([[[1.0, 1, 0, 0], [1, 0, 1, 1]]])
    # learner 1: r̃ = 10·[1,1,0,0] + [1,0,1,1] → μ = 23/8 > 1 → μ = own mean 0.75
    mu = capability_baseline(rewards, 1, omega)
    assert mu.item() == pytest.approx(0.75)
    assert capability_baseline(rewards, 1, omega, baseline_guard=False).item() == pytest.approx(23 / 8)
    sigma = math.sqrt(1.875 / 7)
    adv = capability_aware_advantages(rewards, 1, omega)
    expected = (rewards[0] - 0.75) / (sigma + 1e-6)
    torch.testing.assert_close(adv[0], expected)


def test_sequence_log_ratio_values_and_clamp():
    log_s = sequence_log_ratio(
        torch.tensor([-2.0, -30.0, -1.0]),
        torch.tensor([4, 2, 1]),
        torch.tensor([-3.0, -1.0, -50.0]),
        torch.tensor([6, 1, 2]),
    )
    # −0.5 − (−0.5) = 0 ; −15 − (−1) = −14 → −10 ; −1 − (−25) = 24 → 10
    torch.testing.assert_close(log_s, torch.tensor([0.0, -10.0, 10.0]))
    with pytest.raises(ValueError, match="lengths must be > 0"):
        sequence_log_ratio(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.ones(1))


def test_self_term_is_gspo_clip():
    cfg = HACPOConfig()
    log_r = torch.tensor([0.001, -0.001, 0.001, 0.0])
    adv = torch.tensor([2.0, -2.0, -2.0, 1.0])
    j = hacpo_sequence_objective(log_r, adv, torch.ones(4, dtype=torch.bool), torch.ones(4), 0, cfg)
    s_up, s_down = math.exp(0.001), math.exp(-0.001)
    expected = torch.tensor([1.0004 * 2, -1.9994, -2 * s_up, 1.0])
    torch.testing.assert_close(j, expected)
    assert s_up * 2 > 1.0004 * 2 and -2 * s_down > -1.9994  # the clipped branch is the minimum


def test_cross_term_window_alpha_and_discrepancy():
    cfg = HACPOConfig(alpha=1.0)
    ratios = torch.tensor([0.9, 0.7, 1.2, 0.85])
    m = torch.tensor([0, 0, 0, 4])
    omega_jk = torch.tensor([0.625, 0.625, 1.6, 0.625])
    adv = torch.tensor([1.5, 1.5, -1.0, 2.0])
    out = [
        hacpo_sequence_objective(ratios[i:i + 1].log(), adv[i:i + 1], torch.zeros(1, dtype=torch.bool),
                                 omega_jk[i:i + 1], int(m[i]), cfg).item()
        for i in range(4)
    ]
    # 0.9²·0.625·1.5 ; clamp 0.7→0.8: 0.8²·0.625·1.5 ; clamp 1.2→1: 1.6·(−1) ; m=4: lb 0.9: 0.9²·0.625·2
    assert out == pytest.approx([0.759375, 0.6, -1.6, 1.0125], rel=1e-6)
    assert cross_window(4, cfg) == pytest.approx((0.9, 1.0))
    assert cross_window(20, cfg) == (1.0, 1.0)  # lb_m = min(1, ...)
    assert cross_window(4, HACPOConfig(stepwise=False)) == (0.8, 1.0)


def test_cross_ablations():
    r = torch.tensor([0.5]).log()
    a, cross, omg = torch.tensor([2.0]), torch.zeros(1, dtype=torch.bool), torch.tensor([3.0])
    base = dict(alpha=2.0)
    no_clip = hacpo_sequence_objective(r, a, cross, omg, 0, HACPOConfig(cross_clip=False, **base))
    assert no_clip.item() == pytest.approx(0.5 ** 3 * 3 * 2)
    no_coef = hacpo_sequence_objective(r, a, cross, omg, 0, HACPOConfig(discrepancy_coefficient=False, **base))
    assert no_coef.item() == pytest.approx(0.8 ** 3 * 2)
    naive = hacpo_sequence_objective(r, a, cross, omg, 0, HACPOConfig(algorithm="naive", **base))
    assert naive.item() == pytest.approx(0.5 * 2)  # GSPO: min(s·A, clip(s)·A) = s·A for A > 0, s < 1; no ω, no α
    naive_neg = hacpo_sequence_objective(r, -a, cross, omg, 0, HACPOConfig(algorithm="naive", **base))
    assert naive_neg.item() == pytest.approx(-(1 - 3e-4) * 2)  # A < 0: the clipped branch is the minimum
    with pytest.raises(ValueError, match="grpo_token_loss"):
        hacpo_sequence_objective(r, a, cross, omg, 0, HACPOConfig(algorithm="grpo"))


def test_hacpo_loss_normaliser_and_metrics():
    cfg = HACPOConfig()
    log_r = torch.tensor([0.0, 0.0, math.log(0.5), math.log(0.9)], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    is_self = torch.tensor([True, True, False, False])
    loss, metrics = hacpo_loss(*from_log_ratio(log_r, adv, is_self, torch.ones(4)), 0, cfg, num_sequences=8)
    # J = [1, −1, 0.8², 0.9²] → −Σ/8
    assert loss.item() == pytest.approx(-(1 - 1 + 0.64 + 0.81) / 8)
    assert metrics["cross_clipfrac"] == 0.5 and metrics["self_clipfrac"] == 0.0
    assert metrics["num_self"] == 2 and metrics["num_cross"] == 2
    assert metrics["cross_ratio_min"] == pytest.approx(0.5)


def test_grpo_token_loss_values():
    logp = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    old = torch.log(torch.tensor([0.25, 0.5, 0.9]))
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, metrics = grpo_token_loss(logp, old, adv)
    # ratios 2 → clip 1.28 ; 1 ; 0.5556 with A<0: min(−0.5556, −0.8) = −0.8
    assert loss.item() == pytest.approx(-(1.28 + 1.0 - 0.8) / 3, rel=1e-6)
    assert metrics["token_clipfrac"] == pytest.approx(2 / 3)
