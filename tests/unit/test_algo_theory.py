"""Theorem 4.1, the cross-term gradient, micro-batch equivalence, n = 1 ≡ GSPO, Naive (docs/algorithm.md §2-8, §11)."""

import math

import pytest
import torch

from hacrl_megatron.algo import (
    CapabilityTracker,
    capability_aware_advantages,
    capability_baseline,
    hacpo_loss,
    hacpo_sequence_objective,
    sequence_log_ratio,
)
from hacrl_megatron.config import HACPOConfig
from tests.unit.loss_inputs import from_log_ratio


@pytest.mark.parametrize("rates", [(0.3, 0.7), (0.6, 0.2), (0.25, 0.5, 0.75)])
def test_theorem_4_1_unbiased_baseline_monte_carlo(rates):
    """With ω^(k,j) = p_k / p_j from the true rates, E[μ^(k)] = E_{π_k}[R] = p_k.

    200k prompts of n·8 Bernoulli rewards: the standard error of the mean of μ is below 1e-3,
    so a tolerance of 4e-3 (> 4 standard errors) can only fail when the baseline is biased.
    """
    gen = torch.Generator().manual_seed(0)
    n, g, num_prompts = len(rates), 8, 200_000
    p = torch.tensor(rates, dtype=torch.float64)
    rewards = (torch.rand(num_prompts, n, g, generator=gen, dtype=torch.float64) < p.view(1, n, 1)).double()
    omega = p[:, None] / p[None, :]
    for k in range(n):
        mu = capability_baseline(rewards, k, omega, baseline_guard=False)
        assert mu.mean().item() == pytest.approx(rates[k], abs=4e-3)
        # the plain joint mean is biased towards the group's average rate
        plain = capability_baseline(rewards, k, omega, capability_aware=False, baseline_guard=False)
        assert abs(plain.mean().item() - p.mean().item()) < 4e-3


@pytest.mark.parametrize("alpha", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("m", [0, 2, 5])
def test_cross_gradient_closed_form(alpha, m):
    """∇J_cross = ω·s_c^(α+1)·A·(1/L_k)·Σ_t ∇log π inside [lb_m, 1], 0 outside (docs/algorithm.md §5)."""
    cfg = HACPOConfig(alpha=alpha)
    lb = min(1.0, 0.8 + m * 0.025)
    torch.manual_seed(m)
    theta = torch.randn(5, dtype=torch.float64, requires_grad=True)
    features = torch.randn(6, 5, dtype=torch.float64)  # a toy policy: log π(token t) = -softplus(f_t·θ)
    omega, adv, length = 0.7, -1.3, 6
    for target_ratio in (0.75, 0.87, 0.95, 1.05):  # away from window edges
        token_logp = -torch.nn.functional.softplus(features @ theta)
        learner_sum = token_logp.sum()
        source_mean = learner_sum.detach() / length - math.log(target_ratio)  # makes s = target_ratio
        log_s = sequence_log_ratio(learner_sum.view(1), torch.tensor([length]),
                                   source_mean.view(1) * 2, torch.tensor([2]))
        j = hacpo_sequence_objective(log_s, torch.tensor([adv], dtype=torch.float64),
                                     torch.zeros(1, dtype=torch.bool),
                                     torch.tensor([omega], dtype=torch.float64), m, cfg)
        (grad,) = torch.autograd.grad(j.sum(), theta, retain_graph=True)
        (grad_mean_logp,) = torch.autograd.grad(learner_sum / length, theta)
        s = target_ratio
        inside = lb <= s <= 1.0
        expected = omega * s ** (alpha + 1) * adv * grad_mean_logp if inside else torch.zeros_like(grad)
        torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)


def _random_batch(seed, s=24):
    gen = torch.Generator().manual_seed(seed)
    log_r = (torch.randn(s, generator=gen, dtype=torch.float64) * 0.2)
    adv = torch.randn(s, generator=gen, dtype=torch.float64)
    is_self = torch.rand(s, generator=gen) < 0.5
    disc = torch.where(is_self, torch.ones(s, dtype=torch.float64),
                       torch.rand(s, generator=gen, dtype=torch.float64) * 3 + 0.1)
    return log_r, adv, is_self, disc


@pytest.mark.parametrize("algorithm", ["hacpo", "naive", "gspo"])
def test_micro_batches_sum_to_full_batch_loss_and_gradient(algorithm):
    cfg = HACPOConfig(algorithm=algorithm)
    log_r, adv, is_self, disc = _random_batch(3)
    full_in = log_r.clone().requires_grad_(True)
    full_loss, _ = hacpo_loss(*from_log_ratio(full_in, adv, is_self, disc), 1, cfg)
    full_loss.backward()
    micro_in = log_r.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for idx in torch.tensor_split(torch.arange(24), [5, 6, 17]):  # uneven micro-batches, one of size 1
        loss, _ = hacpo_loss(*from_log_ratio(micro_in[idx], adv[idx], is_self[idx], disc[idx]), 1, cfg,
                             num_sequences=24)
        loss.backward()
        total = total + loss.detach()
    assert total.item() == pytest.approx(full_loss.item(), rel=1e-12)
    torch.testing.assert_close(micro_in.grad, full_in.grad, rtol=1e-12, atol=1e-15)


def _gspo_reference(rewards, log_ratio, eps_low=3e-4, eps_high=4e-4, eps=1e-6):
    """Independent single-agent GSPO: group-normalised advantages, clipped sequence ratio."""
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True)
    adv = (rewards - mean) / (std + eps)
    uniform = (rewards == rewards[..., :1]).all(dim=-1, keepdim=True)
    adv = torch.where(uniform, torch.zeros_like(adv), adv).flatten()
    s = log_ratio.exp()
    return adv, torch.minimum(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv)


def test_single_agent_reduces_exactly_to_gspo():
    gen = torch.Generator().manual_seed(7)
    rewards = (torch.rand(6, 1, 8, generator=gen) < 0.4).double()
    tracker = CapabilityTracker(1)
    tracker.update([float(rewards.mean())])
    adv = capability_aware_advantages(rewards, 0, tracker.omega()).flatten()
    log_r = torch.randn(48, generator=gen, dtype=torch.float64) * 1e-3
    ref_adv, ref_j = _gspo_reference(rewards[:, 0, :], log_r)
    torch.testing.assert_close(adv, ref_adv)
    j = hacpo_sequence_objective(log_r, adv, torch.ones(48, dtype=torch.bool), torch.ones(48, dtype=torch.float64),
                                 0, HACPOConfig())
    torch.testing.assert_close(j, ref_j)


def test_naive_equals_joint_mean_no_coef_alpha0_gspo_clip_for_all():
    gen = torch.Generator().manual_seed(11)
    rewards = (torch.rand(4, 2, 8, generator=gen) < 0.5).double()
    omega = torch.tensor([[1.0, 0.3], [3.3, 1.0]], dtype=torch.float64)
    naive_adv = capability_aware_advantages(rewards, 0, omega, capability_aware=False)
    plain_adv = capability_aware_advantages(rewards, 0, torch.ones(2, 2, dtype=torch.float64))
    torch.testing.assert_close(naive_adv, plain_adv)  # ω ≡ 1 in the baseline
    log_r = torch.randn(64, generator=gen, dtype=torch.float64) * 0.3
    is_self = torch.arange(64) % 16 < 8
    disc = torch.where(is_self, 1.0, 3.3).double()
    j_naive = hacpo_sequence_objective(log_r, naive_adv.flatten(), is_self, disc, 3, HACPOConfig(algorithm="naive", alpha=3.0))
    j_gspo_all = torch.minimum(log_r.exp() * naive_adv.flatten(),
                               log_r.exp().clamp(1 - 3e-4, 1 + 4e-4) * naive_adv.flatten())
    torch.testing.assert_close(j_naive, j_gspo_all)
