"""Hand-computed values and gradients of the HACPO cross-term variants (docs/algorithm.md §5a-5c;
§5d decoupled is in test_algo_decoupled.py).

§5a pessimistic: J = min(s·A, s_c·A)·sg[s_c]^α·ω, s_c = clamp(s, lb_m, 1).
§5c gspo: the same with s_c = clip(s, 1 − ε_low, 1 + ε_high) at every m.
§5b adaptive: the cross term uses s̃ = s·e^(−c); c = 0 while the pair's running median of log s lies
in [log(1 − δ), 0], else c = median − ½·log(1 − δ).
"""

import dataclasses
import math

import pytest
import torch

from hacrl_megatron.algo import CapabilityTracker, adaptive_center, hacpo_loss, hacpo_sequence_objective
from hacrl_megatron.algo.hacpo import hacpo_metrics
from hacrl_megatron.config import ConfigError, HACPOConfig, load_config
from tests.unit.loss_inputs import from_log_ratio

CROSS = torch.zeros(5, dtype=torch.bool)
# in window; below it with A > 0; above it with A < 0; below with A < 0; above with A > 0
RATIOS = torch.tensor([0.9, 0.7, 1.2, 0.7, 1.2], dtype=torch.float64)
ADV = torch.tensor([1.5, 1.5, -1.0, -1.0, 1.0], dtype=torch.float64)
OMEGA = torch.tensor([0.625, 0.625, 1.6, 1.0, 1.0], dtype=torch.float64)
LOG08 = math.log(0.8)


def objective(cfg, ratios=RATIOS, adv=ADV, omega=OMEGA, m=0, center=None):
    return hacpo_sequence_objective(ratios.log(), adv, torch.zeros(len(ratios), dtype=torch.bool), omega, m, cfg,
                                    center=center)


def grad_wrt_log_ratio(cfg, ratios, adv, omega, m=0, center=None):
    log_r = ratios.log().clone().requires_grad_(True)
    j = hacpo_sequence_objective(log_r, adv, torch.zeros(len(ratios), dtype=torch.bool), omega, m, cfg,
                                 center=center)
    (grad,) = torch.autograd.grad(j.sum(), log_r)
    return grad


def test_pessimistic_values_against_clamp():
    clamp = objective(HACPOConfig(alpha=1.0)).tolist()
    pess = objective(HACPOConfig(alpha=1.0, cross_clip_mode="pessimistic")).tolist()
    # clamp: 0.9²·0.625·1.5 ; 0.8²·0.625·1.5 ; 1·1.6·(−1) ; 0.8²·(−1) ; 1·1
    assert clamp == pytest.approx([0.759375, 0.6, -1.6, -0.64, 1.0], rel=1e-12)
    # pessimistic: same in the window; min(0.7·1.5, 0.8·1.5)·0.8·0.625 = 0.525 ; min(−1.2, −1)·1·1.6 = −1.92 ;
    # min(−0.7, −0.8)·0.8 = −0.64 ; min(1.2, 1)·1 = 1
    assert pess == pytest.approx([0.759375, 0.525, -1.92, -0.64, 1.0], rel=1e-12)


@pytest.mark.parametrize("alpha, m", [(0.0, 0), (1.0, 0), (3.0, 4)])
def test_pessimistic_gradient_cases(alpha, m):
    """dJ/dlog s: ω·s^(α+1)·A in the window; ω·lb^α·s·A below it with A > 0; ω·s·A above it with A < 0;
    0 in the two remaining cases (docs/algorithm.md §5a)."""
    cfg = HACPOConfig(alpha=alpha, cross_clip_mode="pessimistic")
    lb = 0.8 + 0.025 * m
    ratios = torch.tensor([0.95, 0.7, 1.2, 0.7, 1.2], dtype=torch.float64)
    got = grad_wrt_log_ratio(cfg, ratios, ADV, OMEGA, m)
    s, a, w = ratios.tolist(), ADV.tolist(), OMEGA.tolist()
    want = [w[0] * s[0] ** (alpha + 1) * a[0], w[1] * lb**alpha * s[1] * a[1], w[2] * s[2] * a[2], 0.0, 0.0]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    clamp = grad_wrt_log_ratio(HACPOConfig(alpha=alpha), ratios, ADV, OMEGA, m)
    torch.testing.assert_close(clamp, torch.tensor([want[0], 0, 0, 0, 0], dtype=torch.float64), rtol=1e-12, atol=0)


def test_pessimistic_leaves_self_term_and_baselines_alone():
    log_r = torch.tensor([0.001, -0.3, 0.2], dtype=torch.float64)
    adv = torch.tensor([2.0, 1.0, -1.0], dtype=torch.float64)
    own = torch.tensor([True, False, False])
    for algorithm in ("naive", "gspo"):
        a = hacpo_sequence_objective(log_r, adv, own, torch.ones(3), 0, HACPOConfig(algorithm=algorithm))
        b = hacpo_sequence_objective(log_r, adv, own, torch.ones(3), 0,
                                     HACPOConfig(algorithm=algorithm, cross_clip_mode="pessimistic"))
        assert torch.equal(a, b)
    a = hacpo_sequence_objective(log_r, adv, own, torch.ones(3), 0, HACPOConfig())
    b = hacpo_sequence_objective(log_r, adv, own, torch.ones(3), 0, HACPOConfig(cross_clip_mode="pessimistic"))
    assert a[0] == b[0] == pytest.approx(1.0004 * 2)


LB, UB = 1 - 3e-4, 1 + 4e-4  # GSPO's default self window, the cross window of §5c


def test_gspo_clip_values():
    got = objective(HACPOConfig(alpha=1.0, cross_clip_mode="gspo")).tolist()
    # min(0.9·1.5, LB·1.5)·LB·0.625 ; min(0.7·1.5, LB·1.5)·LB·0.625 ; min(−1.2, −UB)·UB·1.6 ;
    # min(−0.7, −LB)·LB·1 ; min(1.2, UB)·UB·1
    want = [1.35 * LB * 0.625, 1.05 * LB * 0.625, -1.2 * UB * 1.6, -LB * LB, UB * UB]
    assert got == pytest.approx(want, rel=1e-12)
    late = objective(HACPOConfig(alpha=1.0, cross_clip_mode="gspo"), m=7).tolist()
    assert late == got  # no stepwise tightening: the window is GSPO's at every update


@pytest.mark.parametrize("alpha, m", [(0.0, 0), (1.0, 3), (3.0, 9)])
def test_gspo_clip_gradient_cases(alpha, m):
    """dJ/dlog s: ω·LB^α·s·A below the window with A > 0, ω·UB^α·s·A above it with A < 0, ω·s^(α+1)·A
    inside it, 0 on the bound's side."""
    cfg = HACPOConfig(alpha=alpha, cross_clip_mode="gspo")
    ratios = torch.cat([RATIOS, torch.tensor([1.0001, 0.9999], dtype=torch.float64)])  # two inside the window
    adv = torch.cat([ADV, torch.tensor([2.0, -1.0], dtype=torch.float64)])
    omega = torch.cat([OMEGA, torch.tensor([0.5, 3.0], dtype=torch.float64)])
    got = grad_wrt_log_ratio(cfg, ratios, adv, omega, m)
    s, a, w = ratios.tolist(), adv.tolist(), omega.tolist()
    want = [w[0] * LB**alpha * s[0] * a[0], w[1] * LB**alpha * s[1] * a[1], w[2] * UB**alpha * s[2] * a[2], 0.0, 0.0,
            w[5] * s[5] ** (alpha + 1) * a[5], w[6] * s[6] ** (alpha + 1) * a[6]]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)


def test_gspo_clip_without_coefficients_is_naive():
    """α = 0 and ω = 1: the cross term is GSPO's objective, exactly what ``naive`` gives every sequence."""
    log_r = torch.tensor([0.0002, -0.3, 0.2, -0.0001, 0.5, -2.0], dtype=torch.float64)
    adv = torch.tensor([2.0, 1.0, -1.0, 0.5, -0.5, 1.5], dtype=torch.float64)
    own = torch.tensor([True, False, False, False, False, False])
    ones = torch.ones(6, dtype=torch.float64)
    got = hacpo_sequence_objective(log_r, adv, own, ones, 4, HACPOConfig(alpha=0.0, cross_clip_mode="gspo"))
    naive = hacpo_sequence_objective(log_r, adv, own, ones, 4, HACPOConfig(algorithm="naive"))
    assert torch.equal(got, naive)


def test_gspo_clip_metrics():
    cfg = HACPOConfig(cross_clip_mode="gspo")
    log_r = RATIOS.log()
    m = hacpo_metrics(log_r, ADV, CROSS, 5, cfg, source_index=torch.ones(5, dtype=torch.int64))
    assert m["cross_lower_bound"] == pytest.approx(LB)
    # A > 0: 0.9 and 0.7 keep a gradient, 1.2 is clipped (1/3); A < 0: 1.2 keeps one, 0.7 is clipped (1/2)
    assert m["cross_clipfrac/1/pos"] == pytest.approx(1 / 3) and m["cross_clipfrac/1/neg"] == 0.5
    assert m["cross_clipfrac"] == pytest.approx(2 / 5)


def test_adaptive_center_rule():
    cfg = HACPOConfig(cross_window="adaptive")
    assert adaptive_center(None, cfg) == 0.0
    assert adaptive_center(-0.1, cfg) == 0.0 and adaptive_center(LOG08, cfg) == 0.0 and adaptive_center(0.0, cfg) == 0.0
    assert adaptive_center(0.5, cfg) == pytest.approx(0.5 - 0.5 * LOG08, rel=1e-12)
    assert adaptive_center(-0.7, cfg) == pytest.approx(-0.7 - 0.5 * LOG08, rel=1e-12)
    assert adaptive_center(-0.7, HACPOConfig()) == 0.0  # the fixed window never moves
    assert adaptive_center(-0.7, HACPOConfig(cross_window="adaptive", cross_clip_low=0.5)) == pytest.approx(
        -0.7 - 0.5 * math.log(0.5), rel=1e-12)


def test_adaptive_window_shifts_the_cross_ratio():
    cfg = HACPOConfig(alpha=1.0, cross_window="adaptive")
    ratios = torch.tensor([math.exp(-0.7), math.exp(-0.7), math.exp(0.5)], dtype=torch.float64)
    adv = torch.tensor([2.0, -1.0, -1.0], dtype=torch.float64)
    omega = torch.tensor([0.5, 0.5, 2.0], dtype=torch.float64)
    c_low, c_high = adaptive_center(-0.7, cfg), adaptive_center(0.5, cfg)
    center = torch.tensor([c_low, c_low, c_high], dtype=torch.float64)
    j = objective(cfg, ratios, adv, omega, center=center)
    # s̃ = e^(½·log 0.8) = √0.8 for all three: J = 0.8·ω·A
    torch.testing.assert_close(j, 0.8 * omega * adv, rtol=1e-12, atol=0)
    g = grad_wrt_log_ratio(cfg, ratios, adv, omega, center=center)
    torch.testing.assert_close(g, 0.8 * omega * adv, rtol=1e-12, atol=0)  # ω·s̃^(α+1)·A, s̃² = 0.8
    # without the centre all three lie outside [0.8, 1]: no gradient
    assert torch.count_nonzero(grad_wrt_log_ratio(cfg, ratios, adv, omega)) == 0
    # a zero centre is exactly the paper's window
    zero = torch.zeros(3, dtype=torch.float64)
    assert torch.equal(objective(cfg, ratios, adv, omega, center=zero), objective(HACPOConfig(), ratios, adv, omega))


def test_adaptive_window_keeps_the_stepwise_tightening():
    cfg = HACPOConfig(alpha=0.0, cross_window="adaptive")
    center = torch.tensor([-0.5], dtype=torch.float64)
    ratio = torch.tensor([math.exp(-0.5 + math.log(0.85))], dtype=torch.float64)  # s̃ = 0.85
    a, w = torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    assert objective(cfg, ratio, a, w, m=0, center=center).item() == pytest.approx(0.85)
    assert objective(cfg, ratio, a, w, m=4, center=center).item() == pytest.approx(0.9)  # lb_4 = 0.9


def test_pair_metrics_split_by_source_and_sign():
    cfg = HACPOConfig(cross_clip_mode="pessimistic")
    log_r = torch.tensor([0.0, math.log(0.7), math.log(0.7), math.log(1.2), math.log(0.9), math.log(0.5)],
                         dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -2.0], dtype=torch.float64)
    own = torch.tensor([True, False, False, False, False, False])
    source = torch.tensor([0, 1, 1, 1, 2, 2])
    m = hacpo_metrics(log_r, adv, own, 0, cfg, source_index=source)
    # source 1: A > 0 at 0.7 keeps a gradient (0/1 clipped); A < 0 at 0.7 is clipped, at 1.2 is not (1/2)
    assert m["cross_clipfrac/1/pos"] == 0.0 and m["cross_clipfrac/1/neg"] == 0.5
    assert m["cross_clipfrac/2/pos"] == 0.0 and m["cross_clipfrac/2/neg"] == 1.0
    assert m["cross_log_ratio_median/1"] == pytest.approx(math.log(0.7))
    assert m["cross_log_ratio_median/2"] == pytest.approx((math.log(0.9) + math.log(0.5)) / 2)
    assert m["cross_center/1"] == 0.0 and "cross_clipfrac/0/pos" not in m
    clamp = hacpo_metrics(log_r, adv, own, 0, HACPOConfig(), source_index=source)
    assert clamp["cross_clipfrac/1/pos"] == 1.0 and clamp["cross_clipfrac/1/neg"] == 1.0
    assert clamp["cross_clipfrac"] == pytest.approx(4 / 5) and m["cross_clipfrac"] == pytest.approx(2 / 5)
    centred = hacpo_metrics(log_r, adv, own, 0, HACPOConfig(cross_window="adaptive"), source_index=source,
                            center=torch.tensor([0.0, -0.3, -0.3, -0.3, 0.0, 0.0], dtype=torch.float64))
    assert centred["cross_center/1"] == pytest.approx(-0.3)
    assert centred["cross_clipfrac/1/pos"] == 0.0  # 0.7·e^0.3 = 0.945 lies in the window


def test_hacpo_loss_carries_center_and_pair_metrics():
    log_r = torch.tensor([0.0, -0.7], dtype=torch.float64, requires_grad=True)
    ratio_sum, ones, inputs = from_log_ratio(log_r, torch.tensor([1.0, 1.0]), torch.tensor([True, False]),
                                             torch.ones(2))
    inputs = dataclasses.replace(inputs, source_index=torch.tensor([0, 1]),
                                 cross_center=torch.tensor([0.0, -0.7 - 0.5 * LOG08], dtype=torch.float64))
    loss, metrics = hacpo_loss(ratio_sum, ones, inputs, 0, HACPOConfig(cross_window="adaptive"))
    assert loss.item() == pytest.approx(-(1.0 + 0.8) / 2)  # self 1, cross s̃ = √0.8 → s̃·s̃ = 0.8
    assert metrics["cross_center/1"] == pytest.approx(-0.7 - 0.5 * LOG08)
    with pytest.raises(ValueError, match="cross_center has shape"):
        dataclasses.replace(inputs, cross_center=torch.zeros(3))


def test_tracker_keeps_pair_log_ratio_history_in_its_state():
    tr = CapabilityTracker(2, log_ratio_window=3)
    assert tr.median_log_ratio(0, 1) is None
    for v in (0.1, -0.5, 0.4, 0.3):
        tr.record_log_ratio(0, 1, v)
    tr.record_log_ratio(1, 0, -0.2)
    assert tr.median_log_ratio(0, 1) == pytest.approx(0.3)  # last 3: −0.5, 0.4, 0.3
    assert tr.median_log_ratio(1, 0) == pytest.approx(-0.2)
    tr.update([0.5, 0.5])
    clone = CapabilityTracker(2, log_ratio_window=3)
    clone.load_state_dict(tr.state_dict())
    assert clone.median_log_ratio(0, 1) == tr.median_log_ratio(0, 1) and clone.state_dict() == tr.state_dict()
    old = {k: v for k, v in tr.state_dict().items() if k not in ("log_ratios", "log_ratio_window")}
    legacy = CapabilityTracker(2)
    legacy.load_state_dict(old)  # a checkpoint from before the adaptive window: no pair history
    assert legacy.median_log_ratio(0, 1) is None
    with pytest.raises(ValueError, match="two different agents"):
        tr.record_log_ratio(1, 1, 0.0)
    with pytest.raises(ValueError, match="not finite"):
        tr.record_log_ratio(0, 1, float("nan"))
    with pytest.raises(ValueError, match="log_ratio_window"):
        CapabilityTracker(2, log_ratio_window=0)


@pytest.mark.parametrize("override, message", [
    ("hacpo.cross_clip_mode=both", "hacpo.cross_clip_mode='both': must be one of"),
    ("hacpo.cross_clip_mode=GSPO", "hacpo.cross_clip_mode='GSPO': must be one of"),
    ("hacpo.cross_window=moving", "hacpo.cross_window='moving': must be one of"),
    ("hacpo.adaptive_window_steps=0", "hacpo.adaptive_window_steps=0: must be >= 1"),
])
def test_config_rejects_bad_variant_settings(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("cpu_demo", [override])


def test_config_adaptive_needs_the_cross_clip():
    with pytest.raises(ConfigError, match="needs hacpo.cross_clip=true"):
        load_config("cpu_demo", ["hacpo.cross_window=adaptive", "hacpo.cross_clip=false"])
    with pytest.raises(ConfigError, match=r"hacpo.cross_window='adaptive': .*cross_clip_mode=gspo"):
        load_config("cpu_demo", ["hacpo.cross_window=adaptive", "hacpo.cross_clip_mode=gspo"])
    cfg = load_config("cpu_demo", ["hacpo.cross_window=adaptive", "hacpo.cross_clip_mode=pessimistic"])
    assert (cfg.hacpo.cross_window, cfg.hacpo.cross_clip_mode) == ("adaptive", "pessimistic")
    assert load_config("cpu_demo", []).hacpo.cross_clip_mode == "clamp"
    assert load_config("cpu_demo", ["hacpo.cross_clip_mode=gspo"]).hacpo.cross_clip_mode == "gspo"
