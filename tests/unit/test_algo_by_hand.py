"""Every baseline and ablation against float64 expectations computed here from the equations
(docs/algorithm.md §2-8), not from the package's own functions with other arguments.

One learner (k = 0) of two agents sees a mini-batch of four responses: rows 0-1 its own, rows 2-3
agent 1's. Each expected objective below is written out per row with ``math``; the package's loss
(through the public :class:`~hacrl_megatron.algo.Algorithm`) must equal −Σ J / S.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hacrl_megatron.agents.batch import LogProbOutput, MiniBatchInfo
from hacrl_megatron.algo import LossInputs, build_algorithm
from hacrl_megatron.algo.kl import kl_per_token
from hacrl_megatron.config import HACPOConfig

# the learner's per-token log π_θ of each response, in its own tokens
LEARNER_TOKENS = [[-0.5, -0.7], [-0.2, -0.4, -0.3], [-1.0, -0.6], [-0.1, -0.5]]
SOURCE_SUM = [-1.1, -1.0, -2.7, -0.3]  # Σ log π^(j)_old of each response in its author's tokens
SOURCE_LEN = [2, 3, 3, 3]  # L_j
IS_SELF = [True, True, False, False]
ADV = [1.0, -0.5, 0.8, -1.2]
OMEGA = [1.0, 1.0, 2.0, 2.0]  # ω^(j,k) of each row's author (1 for self)
LEARNER_OLD_SUM = [-1.1, -1.0, -1.5, -0.7]  # Σ log π^(k)_old in the learner's tokens (self rows: = SOURCE_SUM)
REF_TOKENS = [[-0.6, -0.5], [-0.2, -0.5, -0.1], [], []]  # the KL's π_ref on self rows
M = 1  # update index: the cross window's lower bound is 0.8 + 1·0.025 = 0.825 (eq. 14)
EPS_LOW, EPS_HIGH = 3e-4, 4e-4


def learner_mean(i: int) -> float:
    return sum(LEARNER_TOKENS[i]) / len(LEARNER_TOKENS[i])


def log_s(i: int, old_sum: float | None = None, old_len: int | None = None) -> float:
    """eq. 11: (1/L_k) Σ log π^(k)_θ − (1/L_j) Σ log π^(j)_old."""
    old_sum = SOURCE_SUM[i] if old_sum is None else old_sum
    old_len = SOURCE_LEN[i] if old_len is None else old_len
    return learner_mean(i) - old_sum / old_len


def gspo(s: float, a: float) -> float:
    """§4: min(s·A, clip(s, 1 − ε_low, 1 + ε_high)·A)."""
    return min(s * a, min(max(s, 1 - EPS_LOW), 1 + EPS_HIGH) * a)


def hacpo_cross(s: float, a: float, omega: float, low: float, alpha: float = 1.0, clip: bool = True) -> float:
    """eq. 12-13: s_c · s_c^α · ω · A with s_c = clamp(s, lb_m, 1)."""
    s_c = min(max(s, low), 1.0) if clip else s
    return s_c * s_c ** alpha * omega * a


def run_loss(cfg: HACPOConfig, **fields) -> tuple[float, dict[str, float], torch.Tensor]:
    """The package's loss of the four rows under ``cfg``; (loss, metrics, ∂loss/∂token log-probs)."""
    flat = torch.tensor([v for row in LEARNER_TOKENS for v in row], dtype=torch.float64, requires_grad=True)
    lens = torch.tensor([len(r) for r in LEARNER_TOKENS])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    sums = torch.stack([flat[cu[i]:cu[i + 1]].sum() for i in range(4)])
    out = LogProbOutput(token_logps=flat, cu_seqlens=cu, seq_logp_sum=sums, seq_len=lens)
    inputs = LossInputs(advantages=torch.tensor(ADV, dtype=torch.float64), is_self=torch.tensor(IS_SELF),
                        discrepancy=torch.tensor(OMEGA, dtype=torch.float64),
                        source_logp_sum=torch.tensor(SOURCE_SUM, dtype=torch.float64),
                        source_len=torch.tensor(SOURCE_LEN), **fields)
    loss, metrics = build_algorithm(cfg, 2).loss_fn(["a", "b"])(out, inputs, MiniBatchInfo(M, 4, int(lens.sum())))
    (grad,) = torch.autograd.grad(loss, flat)
    return float(loss.detach()), metrics, grad


def paper(**fields) -> HACPOConfig:
    return dataclasses.replace(HACPOConfig(), **fields)


def self_terms() -> float:
    return sum(gspo(math.exp(log_s(i)), ADV[i]) for i in (0, 1))


@pytest.mark.parametrize("name, fields, expected_cross", [
    ("hacpo", {}, lambda i: hacpo_cross(math.exp(log_s(i)), ADV[i], OMEGA[i], 0.825)),
    ("−ω", {"discrepancy_coefficient": False}, lambda i: hacpo_cross(math.exp(log_s(i)), ADV[i], 1.0, 0.825)),
    ("no-clip", {"cross_clip": False}, lambda i: hacpo_cross(math.exp(log_s(i)), ADV[i], OMEGA[i], 0.825, clip=False)),
    ("no-stepwise", {"stepwise": False}, lambda i: hacpo_cross(math.exp(log_s(i)), ADV[i], OMEGA[i], 0.8)),
    ("α = 3", {"alpha": 3.0}, lambda i: hacpo_cross(math.exp(log_s(i)), ADV[i], OMEGA[i], 0.825, alpha=3.0)),
    # −Adv changes the advantages only (test_advantage_ablation_by_hand); given A the objective is HACPO's
    ("−Adv", {"capability_aware_advantage": False}, lambda i: hacpo_cross(math.exp(log_s(i)), ADV[i], OMEGA[i], 0.825)),
    # Naive: GSPO's clip with the ratio to the author's π_old on every row, no ω, α = 0
    ("naive", {"algorithm": "naive"}, lambda i: gspo(math.exp(log_s(i)), ADV[i])),
])
def test_sequence_objectives_by_hand(name, fields, expected_cross):
    want = -(self_terms() + sum(expected_cross(i) for i in (2, 3))) / 4
    loss, _, _ = run_loss(paper(**fields))
    assert loss == pytest.approx(want, rel=1e-12, abs=1e-15), name


def test_the_window_clips_row_3_and_not_row_2():
    """The rows were chosen to sit on both sides: s₂ = e^0.1 > 1 (clamped to 1), s₃ = e^−0.2 < 0.825."""
    assert math.exp(log_s(2)) > 1.0 and 0.8 < math.exp(log_s(3)) < 0.825


def test_naive_merge_by_hand():
    """The plain merge: every row's ratio is the learner's own π_θ/π_old in its own tokens (eq. 11 with
    π^(k)_old and L_k on both sides), then GSPO's clip, no ω, α = 0."""
    want = -sum(gspo(math.exp(learner_mean(i) - LEARNER_OLD_SUM[i] / len(LEARNER_TOKENS[i])), ADV[i])
                for i in range(4)) / 4
    loss, metrics, _ = run_loss(paper(algorithm="naive_merge"),
                                learner_old_logp_sum=torch.tensor(LEARNER_OLD_SUM, dtype=torch.float64))
    assert loss == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert metrics["cross_ratio_max"] == pytest.approx(math.exp(0.05), rel=1e-12)  # row 3: (−0.6 + 0.7)/2
    with pytest.raises(ValueError, match="naive_merge needs LossInputs.learner_old_logp_sum"):
        run_loss(paper(algorithm="naive_merge"))


def test_advantage_ablation_by_hand():
    """eq. 6-7 for one prompt, G = 2: learner 0's rewards (1, 0), agent 1's (1, 1), ω^(0,1) = 0.5 (agent 1
    weaker). HACPO: μ = (1 + 0 + 0.5 + 0.5)/4 = 0.5; −Adv and Naive: μ = 3/4. σ = unbiased std of the
    raw (1, 0, 1, 1) = 0.5 in both."""
    rewards = torch.tensor([[[1.0, 0.0], [1.0, 1.0]]])
    omega = torch.tensor([[1.0, 0.5], [2.0, 1.0]], dtype=torch.float64)
    sigma = math.sqrt(sum((r - 0.75) ** 2 for r in (1, 0, 1, 1)) / 3) + 1e-6
    for fields, mu in (({}, 0.5), ({"capability_aware_advantage": False}, 0.75), ({"algorithm": "naive"}, 0.75),
                       ({"algorithm": "naive_merge"}, 0.75)):
        got = build_algorithm(paper(**fields), 2).advantages(rewards, 0, omega).double()
        want = torch.tensor([[[(1 - mu) / sigma, (0 - mu) / sigma], [(1 - mu) / sigma, (1 - mu) / sigma]]],
                            dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=str(fields))


def k_by_hand(logp: float, ref: float, estimator: str) -> float:
    x = ref - logp
    return {"k1": -x, "k2": 0.5 * x * x, "low_var_kl": min(max(math.exp(x) - x - 1, -10.0), 10.0)}[estimator]


def dk_by_hand(logp: float, ref: float, estimator: str) -> float:
    """∂k/∂logp: k1 → 1, k2 → −x, k3 → 1 − e^x (x = ref − logp)."""
    x = ref - logp
    return {"k1": 1.0, "k2": -x, "low_var_kl": 1.0 - math.exp(x)}[estimator]


@pytest.mark.parametrize("estimator", ["low_var_kl", "k1", "k2"])
def test_kl_penalty_on_self_rows_by_hand(estimator):
    """§7: + kl_coef · Σ_{self rows} mean_t k(t) / S, cross rows none; its gradient per self token is
    kl_coef · ∂k/∂logp / (L_s · S)."""
    coef = 1e-3
    ref = torch.nn.utils.rnn.pad_sequence([torch.tensor(r, dtype=torch.float64) for r in REF_TOKENS], batch_first=True)
    base, _, base_grad = run_loss(paper())
    loss, metrics, grad = run_loss(paper(kl_coef=coef, kl_estimator=estimator), ref_token_logp=ref)
    per_row = [sum(k_by_hand(lp, rf, estimator) for lp, rf in zip(LEARNER_TOKENS[i], REF_TOKENS[i]))
               / len(LEARNER_TOKENS[i]) for i in (0, 1)]
    assert loss - base == pytest.approx(coef * sum(per_row) / 4, rel=1e-9, abs=1e-15)
    assert metrics["kl"] == pytest.approx(sum(per_row) / 2, rel=1e-12)
    want = []
    for i, row in enumerate(LEARNER_TOKENS):
        for t, lp in enumerate(row):
            want.append(coef * dk_by_hand(lp, REF_TOKENS[i][t], estimator) / (len(row) * 4) if IS_SELF[i] else 0.0)
    torch.testing.assert_close(grad - base_grad, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-15)
    with pytest.raises(ValueError, match="kl_coef > 0 needs LossInputs.ref_token_logp"):
        run_loss(paper(kl_coef=coef))


def test_low_var_kl_is_clamped_and_non_negative():
    logp = torch.tensor([-20.0, -1.0, 0.0], dtype=torch.float64)
    ref = torch.tensor([0.0, -1.0, -3.0], dtype=torch.float64)  # x = 20 (e^20 − 21 → clamped), 0, −3
    got = kl_per_token(logp, ref, "low_var_kl")
    torch.testing.assert_close(got, torch.tensor([10.0, 0.0, math.exp(-3) + 3 - 1], dtype=torch.float64))
    with pytest.raises(ValueError, match="hacpo.kl_estimator='k4'"):
        kl_per_token(logp, ref, "k4")


def test_kl_off_leaves_the_loss_function_untouched():
    cfg = paper()
    assert build_algorithm(cfg, 2).passes.reference_on_self is False
    assert build_algorithm(paper(kl_coef=1e-3), 2).passes.reference_on_self is True
    assert build_algorithm(paper(kl_coef=1e-3, algorithm="gspo"), 2).passes.reference_on_self is True
