"""Capability-aware advantage estimation (docs/algorithm.md §2; paper eq. 6-7, App. E eq. 50)."""

from __future__ import annotations

import torch


def _check(rewards: torch.Tensor, learner: int, omega: torch.Tensor) -> None:
    if rewards.dim() != 3:
        raise ValueError(f"rewards must be [P, n, G], got shape {tuple(rewards.shape)}")
    _, n, g = rewards.shape
    if omega.shape != (n, n):
        raise ValueError(f"omega must be [{n}, {n}] for n={n} agents, got {tuple(omega.shape)}")
    if not 0 <= learner < n:
        raise ValueError(f"learner={learner} out of range for n={n} agents")
    if n * g < 2:
        raise ValueError(f"n·G = {n * g}: a prompt group needs at least 2 responses for an unbiased std")


def capability_baseline(
    rewards: torch.Tensor,
    learner: int,
    omega: torch.Tensor,
    *,
    capability_aware: bool = True,
    baseline_guard: bool = True,
    max_reward: float = 1.0,
) -> torch.Tensor:
    """μ^(k) per prompt, [P] float64 (eq. 6).

    μ^(k) = mean over the n·G responses of r̃, where r̃ = R for the learner's own responses and
    r̃ = ω^(k,j)·R for agent j ≠ k (ω ≡ 1 when ``capability_aware`` is False). With
    ``baseline_guard``, μ^(k) > ``max_reward`` falls back to the mean of the learner's own G rewards.
    Under Thm 4.1's conditions (ω from the true success rates) E[μ^(k)] = E_{π_k}[R].
    """
    _check(rewards, learner, omega)
    num_prompts, n, g = rewards.shape
    raw = rewards.to(torch.float64)
    weight = omega[learner].to(torch.float64).clone() if capability_aware else torch.ones(n, dtype=torch.float64)
    weight[learner] = 1.0  # own responses are never re-weighted
    mu = (raw * weight.view(1, n, 1)).reshape(num_prompts, n * g).mean(dim=1)
    if baseline_guard:
        mu = torch.where(mu > max_reward, raw[:, learner, :].mean(dim=1), mu)
    return mu


def capability_aware_advantages(
    rewards: torch.Tensor,
    learner: int,
    omega: torch.Tensor,
    *,
    capability_aware: bool = True,
    uniform_guard: bool = True,
    baseline_guard: bool = True,
    max_reward: float = 1.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Learner k's advantages for all n·G responses of each prompt.

    Args:
        rewards: [P, n, G] raw shared rewards R(y), indexed (prompt, source agent, sample).
        learner: k, the index of the learning agent in ``range(n)``.
        omega: [n, n] capability ratios, ``omega[k, j] = ω^(k,j)`` (eq. 9).
        capability_aware: False gives the −Adv / Naive ablation, a plain joint mean (ω ≡ 1).
        uniform_guard: all n·G raw rewards of a prompt equal ⇒ A = 0 for that prompt.
        baseline_guard: μ^(k) > ``max_reward`` ⇒ μ^(k) = mean of the learner's own G rewards.
        eps: added to σ (eq. 7).

    Returns:
        [P, n, G] float tensor A^(k)(y) = (R(y) − μ^(k)) / (σ + eps), μ^(k) from
        :func:`capability_baseline`, σ = unbiased std of the **raw** n·G rewards. Cross responses
        are scored against the learner's baseline (eq. 50).
    """
    mu = capability_baseline(rewards, learner, omega, capability_aware=capability_aware,
                             baseline_guard=baseline_guard, max_reward=max_reward)
    num_prompts, n, g = rewards.shape
    raw = rewards.to(torch.float64)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if num_prompts == 0:
        return raw.to(out_dtype)
    flat = raw.reshape(num_prompts, n * g)
    sigma = flat.std(dim=1, unbiased=True)
    adv = (raw - mu.view(-1, 1, 1)) / (sigma.view(-1, 1, 1) + eps)
    if uniform_guard:
        uniform = (flat == flat[:, :1]).all(dim=1)
        adv = torch.where(uniform.view(-1, 1, 1), torch.zeros_like(adv), adv)
    return adv.to(out_dtype)
