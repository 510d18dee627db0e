"""Hand-computed values and gradients of the decoupled cross objective (docs/algorithm.md §5d).

J_cross = min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A) · w^(1+α) · ω, with the proximal ratio
r = s / s_old (the learner against its own π_old, differentiable) and the behaviour weight
w = min(1, s_old), s_old = s at the learner's π_old (a constant).
"""

import math

import pytest
import torch

from hacrl_megatron.algo import LossInputs, hacpo_loss, hacpo_sequence_objective
from hacrl_megatron.algo.hacpo import hacpo_metrics
from hacrl_megatron.config import ConfigError, HACPOConfig, load_config

LB, UB = 1 - 3e-4, 1 + 4e-4  # GSPO's default self window, applied to r
DECOUPLED = HACPOConfig(alpha=1.0, cross_clip_mode="decoupled")

# on-policy (r = 1) with s_old 0.9, 0.7, 1.2; then r moved off the window: below with A < 0 (bound side),
# above with A > 0 (bound side), above with A < 0 (unclipped side), below with A > 0 (unclipped side)
S_OLD = torch.tensor([0.9, 0.7, 1.2, 0.7, 1.2, 0.5, 0.6], dtype=torch.float64)
R = torch.tensor([1.0, 1.0, 1.0, 0.9, 1.1, 1.1, 0.95], dtype=torch.float64)
ADV = torch.tensor([1.5, 1.5, -1.0, -1.0, 1.0, -1.0, 2.0], dtype=torch.float64)
OMEGA = torch.tensor([0.625, 0.625, 1.6, 1.0, 1.0, 2.0, 0.5], dtype=torch.float64)
CROSS = torch.zeros(7, dtype=torch.bool)


def objective(cfg, s_old=S_OLD, r=R, adv=ADV, omega=OMEGA, m=0):
    log_s = (s_old * r).log()
    return hacpo_sequence_objective(log_s, adv, torch.zeros(len(r), dtype=torch.bool), omega, m, cfg,
                                    old_log_ratio=s_old.log())


def grad_wrt_log_ratio(cfg, s_old=S_OLD, r=R, adv=ADV, omega=OMEGA, m=0):
    log_s = (s_old * r).log().clone().requires_grad_(True)
    j = hacpo_sequence_objective(log_s, adv, torch.zeros(len(r), dtype=torch.bool), omega, m, cfg,
                                 old_log_ratio=s_old.log())
    (grad,) = torch.autograd.grad(j.sum(), log_s)
    return grad


def test_decoupled_values():
    got = objective(DECOUPLED).tolist()
    want = [
        1.5 * 0.9**2 * 0.625,  # on-policy: A·w²·ω, w = 0.9 (HACPO's in-window value)
        1.5 * 0.7**2 * 0.625,  # w = 0.7, below HACPO's window: still weighted, not clipped
        -1.0 * 1.0 * 1.6,  # w = min(1, 1.2) = 1
        -LB * 0.7**2,  # min(−0.9, −LB)·w²: the bound
        UB * 1.0,  # min(1.1, UB)·1: the bound
        -1.1 * 0.5**2 * 2.0,  # min(−1.1, −UB) = −1.1
        0.95 * 2.0 * 0.6**2 * 0.5,  # min(1.9, 2·LB) = 1.9
    ]
    assert got == pytest.approx(want, rel=1e-12)
    assert objective(DECOUPLED, m=6).tolist() == got  # no stepwise tightening


@pytest.mark.parametrize("alpha, m", [(0.0, 0), (1.0, 1), (3.0, 5)])
def test_decoupled_gradient_cases(alpha, m):
    """dJ/dlog s = ω·w^(1+α)·r·A where the update moves r towards the window or r is inside it, else 0."""
    cfg = HACPOConfig(alpha=alpha, cross_clip_mode="decoupled")
    got = grad_wrt_log_ratio(cfg, m=m)
    w, r, a, om = S_OLD.clamp(max=1.0), R, ADV, OMEGA
    full = om * w ** (1 + alpha) * r * a
    want = torch.where(torch.tensor([True, True, True, False, False, True, True]), full, torch.zeros(7, dtype=torch.float64))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 3.0])
def test_first_update_matches_hacpo_inside_its_window_and_trains_outside_it(alpha):
    """At r = 1 (the first update of a step), s_old in [lb_0, 1] gets exactly HACPO's in-window gradient
    ω·s^(α+1)·A; outside the window, where HACPO's clamp gives none, decoupled gives ω·min(1, s)^(1+α)·A."""
    s = torch.tensor([0.8, 0.85, 1.0, 0.5, 1.5, 0.3], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 0.5, 1.0, -1.0, -1.0], dtype=torch.float64)
    omega = torch.tensor([0.5, 2.0, 1.0, 1.5, 1.0, 3.0], dtype=torch.float64)
    ones = torch.ones(6, dtype=torch.float64)
    dec = grad_wrt_log_ratio(HACPOConfig(alpha=alpha, cross_clip_mode="decoupled"), s, ones, adv, omega)
    log_s = s.log().clone().requires_grad_(True)
    clamp_j = hacpo_sequence_objective(log_s, adv, torch.zeros(6, dtype=torch.bool), omega, 0, HACPOConfig(alpha=alpha))
    (clamp,) = torch.autograd.grad(clamp_j.sum(), log_s)
    torch.testing.assert_close(dec[:3], clamp[:3], rtol=1e-12, atol=0)
    assert clamp[3:].tolist() == [0.0, 0.0, 0.0]
    want = omega[3:] * s[3:].clamp(max=1.0) ** (1 + alpha) * adv[3:]
    torch.testing.assert_close(dec[3:], want, rtol=1e-12, atol=0)


def test_decoupled_leaves_self_sequences_to_gspo():
    log_s = torch.tensor([0.0001, -0.3, 0.2], dtype=torch.float64)
    adv = torch.tensor([2.0, 1.0, -1.0], dtype=torch.float64)
    own = torch.tensor([True, False, False])
    ones = torch.ones(3, dtype=torch.float64)
    old = torch.tensor([0.0, -0.3, 0.2], dtype=torch.float64)
    dec = hacpo_sequence_objective(log_s, adv, own, ones, 0, DECOUPLED, old_log_ratio=old)
    clamp = hacpo_sequence_objective(log_s, adv, own, ones, 0, HACPOConfig())
    assert dec[0] == clamp[0] == pytest.approx(math.exp(0.0001) * 2, rel=1e-12)  # inside the band: s·A
    naive = hacpo_sequence_objective(log_s, adv, own, ones, 0, HACPOConfig(algorithm="naive", cross_clip_mode="decoupled"))
    assert torch.equal(naive, hacpo_sequence_objective(log_s, adv, own, ones, 0, HACPOConfig(algorithm="naive")))


def test_decoupled_without_clip_uses_r_raw():
    cfg = HACPOConfig(alpha=0.0, cross_clip_mode="decoupled", cross_clip=False)
    got = objective(cfg).tolist()
    want = (R * ADV * S_OLD.clamp(max=1.0) * OMEGA).tolist()
    assert got == pytest.approx(want, rel=1e-12)


def test_decoupled_needs_the_old_log_ratio():
    with pytest.raises(ValueError, match="needs old_log_ratio"):
        hacpo_sequence_objective(R.log(), ADV, CROSS, OMEGA, 0, DECOUPLED)
    with pytest.raises(ValueError, match=r"old_log_ratio has shape \(3,\), expected \(7,\)"):
        hacpo_sequence_objective(R.log(), ADV, CROSS, OMEGA, 0, DECOUPLED, old_log_ratio=torch.zeros(3))


def _inputs(learner_old=None):
    # L_k = 4, L_j = 2: learner mean −0.5 now and −0.6 at π_old, source mean −0.5, so log s = 0,
    # log s_old = −0.1 and log r = +0.1 (above GSPO's band); a self sequence with L = 3 next to it
    return LossInputs(advantages=torch.tensor([-1.0, 1.0], dtype=torch.float64), is_self=torch.tensor([False, True]),
                      discrepancy=torch.tensor([0.5, 1.0], dtype=torch.float64),
                      source_logp_sum=torch.tensor([-1.0, -0.9], dtype=torch.float64),
                      source_len=torch.tensor([2, 3]), source_index=torch.tensor([1, 0]),
                      learner_old_logp_sum=learner_old)


def test_hacpo_loss_uses_the_learner_lengths_for_the_old_ratio():
    learner_sum = torch.tensor([-2.0, -0.9], dtype=torch.float64, requires_grad=True)
    lens = torch.tensor([4, 3])
    inputs = _inputs(torch.tensor([-2.4, -0.9], dtype=torch.float64))
    loss, metrics = hacpo_loss(learner_sum, lens, inputs, 0, DECOUPLED, num_sequences=4)
    j_cross = -math.exp(0.1) * math.exp(-0.1) ** 2 * 0.5  # r·A·w²·ω on the unclipped side (A < 0, r > 1)
    j_self = 1.0  # s = 1, A = 1
    assert float(loss.detach()) == pytest.approx(-(j_cross + j_self) / 4, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, learner_sum)
    # dJ/dΣlogπ = dJ/dlog s / L_k; self: on-policy GSPO gives A/L = 1/3
    assert grad.tolist() == pytest.approx([-j_cross / 4 / 4, -1.0 / 3 / 4], rel=1e-12)
    assert metrics["cross_behaviour_weight_mean"] == pytest.approx(math.exp(-0.1))
    assert metrics["cross_clipfrac"] == 0.0  # r > 1 with A < 0 keeps its gradient
    assert metrics["cross_clipfrac/1/neg"] == 0.0


def test_hacpo_loss_names_the_missing_field():
    learner_sum = torch.tensor([-2.0, -0.9], dtype=torch.float64)
    with pytest.raises(ValueError, match="needs LossInputs.learner_old_logp_sum"):
        hacpo_loss(learner_sum, torch.tensor([4, 3]), _inputs(), 0, DECOUPLED)
    # the other modes and methods ignore it, present or not
    for cfg in (HACPOConfig(), HACPOConfig(cross_clip_mode="gspo"), HACPOConfig(algorithm="naive", cross_clip_mode="decoupled")):
        a, _ = hacpo_loss(learner_sum, torch.tensor([4, 3]), _inputs(), 0, cfg)
        b, _ = hacpo_loss(learner_sum, torch.tensor([4, 3]), _inputs(torch.tensor([-9.0, -9.0])), 0, cfg)
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"LossInputs.learner_old_logp_sum has shape \(3,\), expected \(2,\)"):
        _inputs(torch.zeros(3))


def test_decoupled_metrics_clip_on_r():
    m = hacpo_metrics((S_OLD * R).log(), ADV, CROSS, 3, DECOUPLED, source_index=torch.ones(7, dtype=torch.int64),
                      old_log_ratio=S_OLD.log())
    # no gradient: r = 0.9 with A < 0 and r = 1.1 with A > 0, i.e. one of 4 positives and one of 3 negatives
    assert m["cross_clipfrac/1/pos"] == pytest.approx(1 / 4) and m["cross_clipfrac/1/neg"] == pytest.approx(1 / 3)
    assert m["cross_clipfrac"] == pytest.approx(2 / 7)
    assert m["cross_lower_bound"] == pytest.approx(LB)
    assert m["cross_behaviour_weight_mean"] == pytest.approx(float(S_OLD.clamp(max=1.0).mean()))
    assert m["cross_ratio_max"] == pytest.approx(1.32)  # ratio statistics stay those of the raw s


def test_config_accepts_decoupled_and_refuses_it_with_the_adaptive_window():
    assert load_config("cpu_demo", ["hacpo.cross_clip_mode=decoupled"]).hacpo.cross_clip_mode == "decoupled"
    with pytest.raises(ConfigError, match=r"hacpo.cross_window='adaptive': .*cross_clip_mode=decoupled"):
        load_config("cpu_demo", ["hacpo.cross_window=adaptive", "hacpo.cross_clip_mode=decoupled"])
