"""Property-based tests (hypothesis): shapes, NaN-freedom, degenerate groups, empty batches."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hacrl_megatron.algo import CapabilityTracker, capability_aware_advantages, hacpo_loss
from hacrl_megatron.config import HACPOConfig
from tests.unit.loss_inputs import from_log_ratio

shapes = st.tuples(st.integers(0, 4), st.integers(1, 4), st.integers(1, 6)).filter(lambda t: t[1] * t[2] >= 2)


@st.composite
def reward_batches(draw):
    p, n, g = draw(shapes)
    kind = draw(st.sampled_from(["binary", "zeros", "ones", "float"]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    if kind == "binary":
        r = (torch.rand(p, n, g, generator=gen) < 0.5).float()
    elif kind == "zeros":
        r = torch.zeros(p, n, g)
    elif kind == "ones":
        r = torch.ones(p, n, g)
    else:
        r = torch.rand(p, n, g, generator=gen)
    rates = draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))
    return r, rates, kind


@settings(max_examples=150, deadline=None)
@given(reward_batches(), st.booleans(), st.booleans())
def test_advantages_shape_finite_and_degenerate_groups(batch, capability_aware, baseline_guard):
    rewards, rates, kind = batch
    n = rewards.shape[1]
    tracker = CapabilityTracker(n)
    tracker.update(rates)
    omega = tracker.omega()
    assert torch.isfinite(omega).all() and (omega >= 0.1).all() and (omega <= 10).all()
    for k in range(n):
        adv = capability_aware_advantages(rewards, k, omega, capability_aware=capability_aware,
                                          baseline_guard=baseline_guard)
        assert adv.shape == rewards.shape
        assert torch.isfinite(adv).all()
        if kind in ("zeros", "ones"):
            assert torch.equal(adv, torch.zeros_like(adv))  # uniform guard: no signal from equal groups


@settings(max_examples=150, deadline=None)
@given(
    st.integers(0, 12),
    st.integers(0, 10),
    st.sampled_from(["hacpo", "naive", "gspo"]),
    st.floats(0, 5),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_loss_finite_for_any_mix_including_empty_groups(s, m, algorithm, alpha, stepwise, seed):
    gen = torch.Generator().manual_seed(seed)
    log_r = (torch.randn(s, generator=gen) * 3).clamp(-10, 10).requires_grad_(True)
    adv = torch.randn(s, generator=gen) * 3
    mix = torch.rand(s, generator=gen)
    is_self = mix < (seed % 3) / 2  # all cross, half, or all self
    disc = torch.rand(s, generator=gen) * 9.9 + 0.1
    cfg = HACPOConfig(algorithm=algorithm, alpha=alpha, stepwise=stepwise)
    loss, metrics = hacpo_loss(*from_log_ratio(log_r, adv, is_self, disc), m, cfg, num_sequences=max(s, 1) * 2)
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(log_r.grad).all()
    assert all(v == v for v in metrics.values())  # no NaN metric, even with no self or no cross sequence
    assert 0.0 <= metrics["cross_clipfrac"] <= 1.0 and 0.0 <= metrics["self_clipfrac"] <= 1.0
