"""``hacpo.log_cross_grad_share``: ‖g_cross‖/‖g‖ with g = ∂ΣJ/∂ℓ per sequence (docs/algorithm.md §10b),
against values computed by hand from the gradient of §5 (ω·s_c^(α+1)·A inside the window, 0 outside)
and of GSPO's self term (s·A inside its clip)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hacrl_megatron.algo import LossInputs
from hacrl_megatron.algo.hacpo import cross_grad_share, hacpo_loss
from hacrl_megatron.config import HACPOConfig

CFG = HACPOConfig(alpha=1.0, cross_clip_low=0.8, delta_step=0.025, log_cross_grad_share=True)


def batch(log_s: list[float], adv: list[float], is_self: list[bool], omega: list[float]):
    """One token per response on both sides (L_k = L_j = 1), the source's log π_old = −1, so log s is the
    learner's log-prob + 1."""
    source = torch.full((len(log_s),), -1.0, dtype=torch.float64)
    learner = (torch.tensor(log_s, dtype=torch.float64) + source).requires_grad_(True)
    inputs = LossInputs(advantages=torch.tensor(adv, dtype=torch.float64), is_self=torch.tensor(is_self),
                        discrepancy=torch.tensor(omega, dtype=torch.float64), source_logp_sum=source,
                        source_len=torch.ones(len(log_s), dtype=torch.int64))
    return learner, torch.ones(len(log_s), dtype=torch.int64), inputs


def test_the_share_is_the_cross_rows_norm_of_the_sequence_gradient():
    # two own samples at s = 1 (GSPO: dJ/dlog s = s·A), a cross one inside [0.8, 1] at s = 0.9 with ω 2,
    # A 0.5 (0.9^2 · 2 · 0.5 = 0.81), a cross one below the window (no gradient)
    learner, lens, inputs = batch([0.0, 0.0, math.log(0.9), math.log(0.5)], [1.0, -1.0, 0.5, 0.7],
                                  [True, True, False, False], [1.0, 1.0, 2.0, 2.0])
    loss, metrics = hacpo_loss(learner, lens, inputs, 0, CFG)
    assert metrics["cross_grad_share"] == pytest.approx(0.81 / math.sqrt(1 + 1 + 0.81**2), rel=1e-12)  # float64
    loss.backward()  # the share's own backward leaves the loss's graph and gradient intact
    assert learner.grad.tolist() == pytest.approx([-1 / 4, 1 / 4, -0.81 / 4, 0.0], rel=1e-12)


def test_no_cross_gradient_gives_zero_and_no_graph_gives_none():
    learner, lens, inputs = batch([0.0, math.log(0.5)], [1.0, 1.0], [True, False], [1.0, 1.0])
    assert hacpo_loss(learner, lens, inputs, 0, CFG)[1]["cross_grad_share"] == 0.0  # the cross one is clipped
    only_cross = batch([math.log(0.95)], [1.0], [False], [1.0])
    assert hacpo_loss(*only_cross, 0, CFG)[1]["cross_grad_share"] == 1.0
    with torch.no_grad():
        assert "cross_grad_share" not in hacpo_loss(*batch([0.0], [1.0], [True], [1.0]), 0, CFG)[1]
    off = dataclasses.replace(CFG, log_cross_grad_share=False)  # the default: the key is not logged
    assert "cross_grad_share" not in hacpo_loss(*batch([0.0], [1.0], [True], [1.0]), 0, off)[1]
    zero = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    assert cross_grad_share(zero * 0, zero, torch.tensor([True, False])) == 0.0  # g = 0
