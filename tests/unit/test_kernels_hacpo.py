"""``fused_hacpo_loss`` equals ``algo.hacpo_loss`` on the same inputs (value, metrics, gradients).

The unfused path is the composition the trainer would otherwise build: per-sequence sums from
full [N, V] logits in float64 → ``hacpo_loss`` → autograd. Source
log-prob sums are set so that the ratios s straddle every clip boundary (self ε band, the cross
window [lb_m, 1] for each m), so both active and clipped branches are exercised.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hacrl_megatron.algo import LossInputs, hacpo_loss
from hacrl_megatron.config import HACPOConfig
from hacrl_megatron.kernels import fused_hacpo_loss, fused_sequence_loss, sequence_logprobs

torch.set_num_threads(1)

LENS = [4, 1, 9, 6, 12, 3, 7, 2]
# log s per sequence: self ones sit inside / outside GSPO's ±3e-4 band, cross ones inside and
# outside [0.8, 1] and the later windows [0.825, 1], [0.85, 1], ...
LOG_S = [0.0001, -0.0005, -0.10, -0.30, -0.19, 0.05, -0.02, -0.16]
IS_SELF = [True, True, False, False, False, False, True, False]
ADV = [0.9, -1.1, 0.7, -0.6, 1.3, 0.4, 0.0, -0.8]
OMEGA = [1.0, 1.0, 2.0, 0.5, 3.0, 1.5, 1.0, 0.7]
# decoupled (docs/algorithm.md §5d): log r = log π_θ − log π^(k)_old per token of each sequence, inside and
# outside GSPO's band on both sides; with LOG_S this puts log s at π_old (= log s − log r) above and below 0
LOG_R = [0.0, 0.0, 0.0001, -0.001, 0.002, -0.0002, 0.0, 0.0005]
# adaptive window: the learner is agent 0; cross sequences come from agents 1 and 2 with centres −0.25, 0.1
SOURCE = [0, 0, 1, 1, 2, 2, 0, 1]
CENTER = [0.0, 0.0, -0.25, -0.25, 0.1, 0.1, 0.0, -0.25]


def make_inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, h, v = sum(LENS), 10, 43
    hidden = (torch.randn(n, h, generator=g) * 0.6).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * 0.6).to(dtype).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])
    return hidden, weight, targets, cu


def full_logits_sums(hidden, weight, targets, cu, temperature):
    logits = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    return torch.stack([logp[a:b].sum() for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])


def sequence_tensors(hidden, weight, targets, cu, temperature):
    """Source statistics placing log s at LOG_S (computed from the current learner sums)."""
    with torch.no_grad():
        learner = full_logits_sums(hidden, weight, targets, cu, temperature).double()
    lens = torch.tensor(LENS, dtype=torch.float64)
    src_len = torch.tensor([5, 1, 11, 6, 10, 3, 7, 4])
    src_sum = (learner / lens - torch.tensor(LOG_S, dtype=torch.float64)) * src_len
    return LossInputs(advantages=torch.tensor(ADV, dtype=torch.float64), is_self=torch.tensor(IS_SELF),
                      discrepancy=torch.tensor(OMEGA, dtype=torch.float64), source_logp_sum=src_sum,
                      source_len=src_len)


def unfused(hidden, weight, targets, cu, inputs, update_index, cfg, num_sequences, temperature):
    sums = full_logits_sums(hidden, weight, targets, cu, temperature)
    return hacpo_loss(sums, torch.tensor(LENS), inputs, update_index, cfg, num_sequences)


CONFIGS = {
    "hacpo_a1": HACPOConfig(alpha=1.0),
    "hacpo_a0": HACPOConfig(alpha=0.0),
    "hacpo_a3": HACPOConfig(alpha=3.0, cross_clip_low=0.8, delta_step=0.01),
    "no_omega": HACPOConfig(discrepancy_coefficient=False),
    "no_clip": HACPOConfig(cross_clip=False),
    "no_stepwise": HACPOConfig(stepwise=False),
    "naive": HACPOConfig(algorithm="naive", alpha=0.0),
    "pessimistic": HACPOConfig(alpha=1.0, cross_clip_mode="pessimistic"),
    "pessimistic_a3": HACPOConfig(alpha=3.0, cross_clip_mode="pessimistic", delta_step=0.01),
    "adaptive": HACPOConfig(cross_window="adaptive"),
    "adaptive_pessimistic": HACPOConfig(cross_window="adaptive", cross_clip_mode="pessimistic"),
    "gspo_clip": HACPOConfig(alpha=1.0, cross_clip_mode="gspo"),
    "decoupled": HACPOConfig(alpha=1.0, cross_clip_mode="decoupled"),
    "decoupled_a3_no_omega": HACPOConfig(alpha=3.0, cross_clip_mode="decoupled", discrepancy_coefficient=False),
    "gspo": HACPOConfig(algorithm="gspo"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("update_index", [0, 2, 5])
def test_fused_equals_algo_hacpo_loss(name, update_index):
    cfg = CONFIGS[name]
    temperature = 0.8 if update_index == 2 else 1.0
    hidden, weight, targets, cu = make_inputs()
    seq = sequence_tensors(hidden, weight, targets, cu, temperature)
    if cfg.cross_clip_mode == "decoupled":
        with torch.no_grad():
            learner = full_logits_sums(hidden, weight, targets, cu, temperature).double()
        old = learner - torch.tensor(LOG_R, dtype=torch.float64) * torch.tensor(LENS, dtype=torch.float64)
        seq = dataclasses.replace(seq, learner_old_logp_sum=old)
    if cfg.cross_window == "adaptive":  # per-pair centres (docs/algorithm.md §5b) move sequences 3, 4 into the window
        seq = dataclasses.replace(seq, source_index=torch.tensor(SOURCE),
                                  cross_center=torch.tensor(CENTER, dtype=torch.float64))
    loss, metrics = fused_hacpo_loss(hidden, weight, targets, cu, update_index=update_index, cfg=cfg,
                                     num_sequences=11, temperature=temperature, impl="reference", chunk_size=5,
                                     inputs=seq)
    got = torch.autograd.grad(loss, (hidden, weight))
    ref_loss, ref_metrics = unfused(hidden, weight, targets, cu, seq, update_index, cfg, 11, temperature)
    want = torch.autograd.grad(ref_loss, (hidden, weight))
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=1e-12)
    assert metrics.keys() == ref_metrics.keys()
    for key in metrics:
        assert metrics[key] == pytest.approx(ref_metrics[key], abs=1e-9), key
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert float(got[0].abs().max()) > 1e-4  # some sequence is inside its window


def test_clipped_sequences_contribute_no_gradient():
    """Only sequence 2 (cross, s = e^-0.1 = 0.905 inside [0.875, 1]) is trained; the rest are clipped or A = 0."""
    hidden, weight, targets, cu = make_inputs()
    seq = sequence_tensors(hidden, weight, targets, cu, 1.0)
    keep = torch.tensor([False, False, True, False, False, False, False, False])
    seq = dataclasses.replace(seq, advantages=torch.where(
        keep | torch.tensor([False, False, False, True, False, False, True, True]), seq.advantages,
        torch.zeros(8, dtype=torch.float64)))
    # at m = 3 the window is [0.875, 1]: sequences 3 (s = 0.741) and 7 (s = 0.852) lie below it
    loss, _ = fused_hacpo_loss(hidden, weight, targets, cu, update_index=3, cfg=HACPOConfig(), impl="reference",
                               inputs=seq)
    dh, _ = torch.autograd.grad(loss, (hidden, weight))
    rows = torch.zeros(sum(LENS), dtype=torch.bool)
    rows[int(cu[2]):int(cu[3])] = True
    assert torch.all(dh[~rows] == 0) and torch.all(dh[rows].abs().sum(1) > 0)
    # and its magnitude matches docs/algorithm.md §5's gradient check: ω·s^(α+1)·A/(L_k·S) times d(Σ logp)
    s = torch.exp(torch.tensor(LOG_S[2], dtype=torch.float64))
    coef = OMEGA[2] * s**2 * ADV[2] / (LENS[2] * 8)
    sums_grad = torch.autograd.grad(full_logits_sums(hidden, weight, targets, cu, 1.0)[2], hidden)[0]
    torch.testing.assert_close(dh, -coef * sums_grad, rtol=1e-9, atol=1e-12)


def test_fused_sequence_loss_with_custom_loss_and_float32_inputs():
    hidden, weight, targets, cu = make_inputs(torch.float32)
    coef = torch.linspace(-1, 1, len(LENS))

    def loss_fn(seq_sums):
        return (coef * seq_sums).sum() ** 2 / 100, {"total": float(seq_sums.detach().sum())}

    loss, metrics = fused_sequence_loss(hidden, weight, targets, cu, loss_fn, temperature=1.3, impl="reference",
                                        chunk_size=3)
    got = torch.autograd.grad(loss, (hidden, weight))
    sums = full_logits_sums(hidden, weight, targets, cu, 1.3)
    ref, _ = loss_fn(sums)
    want = torch.autograd.grad(ref, (hidden, weight))
    assert metrics["total"] == pytest.approx(float(sums.detach().sum()), rel=1e-6)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_rejects_mismatched_sequence_tensors_and_token_level_algorithms():
    hidden, weight, targets, cu = make_inputs()
    seq = sequence_tensors(hidden, weight, targets, cu, 1.0)
    with pytest.raises(ValueError, match=r"LossInputs.is_self has shape \(7,\), expected \(8,\) like advantages"):
        dataclasses.replace(seq, is_self=seq.is_self[:-1])
    with pytest.raises(ValueError, match="is_self must be a bool tensor"):
        dataclasses.replace(seq, is_self=seq.is_self.float())
    short = seq.select(torch.arange(7))
    with pytest.raises(ValueError, match="inputs hold 7 sequences, expected S=8"):
        fused_hacpo_loss(hidden, weight, targets, cu, update_index=0, cfg=HACPOConfig(), inputs=short)
    with pytest.raises(ValueError, match="grpo"):
        fused_hacpo_loss(hidden, weight, targets, cu, update_index=0,
                         cfg=dataclasses.replace(HACPOConfig(), algorithm="grpo"), inputs=seq)


def test_on_policy_ratio_is_exactly_one_across_batch_compositions():
    """Old log-probs from the whole step batch, new ones inside a differently composed mini-batch:
    the same kernel path gives s = 1 exactly (no spurious self clipping at ε ≈ 3e-4)."""
    hidden, weight, targets, cu = make_inputs(torch.float32)
    with torch.no_grad():
        old = sequence_logprobs(hidden, weight, targets, cu, impl="reference")
    pick = [6, 2, 4]  # a mini-batch: three sequences in another order
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    idx = torch.cat([torch.arange(*bounds[s]) for s in pick])
    lens = torch.tensor([LENS[s] for s in pick])
    cu_mb = torch.tensor([0, *lens.cumsum(0).tolist()])
    inputs = LossInputs(advantages=torch.tensor([1.0, -1.0, 0.5]), is_self=torch.ones(3, dtype=torch.bool),
                        discrepancy=torch.ones(3), source_logp_sum=old.seq_logp_sum[pick], source_len=lens)
    loss, metrics = fused_hacpo_loss(hidden[idx], weight, targets[idx], cu_mb, inputs=inputs, update_index=0,
                                     cfg=HACPOConfig(), impl="reference")
    assert metrics["self_ratio_min"] == 1.0 and metrics["self_ratio_max"] == 1.0
    assert metrics["self_clipfrac"] == 0.0
    assert float(loss.detach()) == pytest.approx(-(1.0 - 1.0 + 0.5) / 3, rel=1e-6)
