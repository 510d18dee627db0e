"""Mutual RL's three probes and F-TIS (algo/peer_sharing.py, algo/algorithm.py; docs/algorithm.md §8a):
what each asks of a step, hand-computed advantages, weights, losses and gradients, the config rules, and one
training step of each through the real loop on the two tiny agents (different tokenizers).

Values are float64 and compared at rtol 1e-12 (the same few operations as the hand formula, in another
order) unless a test says otherwise; advantages include the ε = 1e-6 of eq. 7 in the hand formula.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from hacrl_megatron.algo import LossInputs, StepPasses, build_algorithm, grpo_token_loss
from hacrl_megatron.algo.peer_sharing import peer_token_loss, peer_weights, sgt_transfer_mask
from hacrl_megatron.config import ConfigError, HACPOConfig, load_config
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.trainer import loop, stages
from hacrl_megatron.trainer.peers import PeerExchange
from tests.e2e.test_trainer import exported, parity_reward, tiny_exp

PEER_METHODS = ("mutual_prp", "mutual_xgrpo", "mutual_sgt", "ftis")
EPS = 1e-6  # eq. 7's ε
R12 = dict(rtol=1e-12, atol=1e-15)


def algo(name: str, n: int = 2, **fields):
    return build_algorithm(dataclasses.replace(HACPOConfig(algorithm=name), **fields), n)


def out_of(token_logps: list[float], lengths: list[int]) -> SimpleNamespace:
    """A LogProbOutput whose sequence sums are the token sums (so gradients reach the tokens through both)."""
    tokens = torch.tensor(token_logps, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)
    sums = torch.stack([tokens[cu[i]:cu[i + 1]].sum() for i in range(len(lengths))])
    return SimpleNamespace(token_logps=tokens, cu_seqlens=cu, seq_logp_sum=sums, seq_len=torch.tensor(lengths))


def info(num_tokens: int, num_sequences: int = 1) -> SimpleNamespace:
    return SimpleNamespace(update_index=0, num_sequences=num_sequences, num_tokens=num_tokens)


def one_token_inputs(logps: list[float], adv: list[float], own: list[bool], log_s_old: list[float]) -> LossInputs:
    """S one-token sequences at the first update (π_old = π_θ, so r = ρ = 1) whose log s_old is given:
    learner Σ log π_old = the token log-prob, L_k = L_j = 1, the author's Σ = learner's − log s_old."""
    lp = torch.tensor(logps, dtype=torch.float64)
    shift = torch.tensor(log_s_old, dtype=torch.float64)
    ones = torch.ones(len(logps), dtype=torch.long)
    return LossInputs(advantages=torch.tensor(adv, dtype=torch.float64), is_self=torch.tensor(own),
                      discrepancy=torch.ones(len(logps), dtype=torch.float64), source_logp_sum=lp - shift,
                      source_len=ones, old_token_logp=lp.view(-1, 1).clone(), learner_old_logp_sum=lp.clone())


def token_grads(name: str, inputs: LossInputs, logps: list[float], **fields) -> torch.Tensor:
    out = out_of(logps, [1] * len(logps))
    loss, _ = algo(name, **fields).loss_fn(["a", "b"])(out, inputs, info(len(logps), len(logps)))
    (grad,) = torch.autograd.grad(loss, out.token_logps)
    return grad


# ---- what each method asks of a step ----------------------------------------------------------------
@pytest.mark.parametrize("name, sources_of_1, passes", [
    ("mutual_prp", [0, 1, 2], StepPasses(source_token_logps=True, learner_old_on_others=True)),
    ("mutual_xgrpo", [1], StepPasses(source_token_logps=True)),
    ("mutual_sgt", [0, 1, 2], StepPasses(source_token_logps=True, learner_old_on_others=True)),
    ("ftis", [0, 1, 2], StepPasses(source_token_logps=True, learner_old_on_others=True)),
])
def test_what_each_method_asks_of_a_step(name, sources_of_1, passes):
    a = algo(name, 3)
    assert a.name == name and a.samples_per_prompt(4) == 4
    assert a.sources(1) == sources_of_1
    assert a.passes == passes
    assert a.passes == dataclasses.replace(passes, reference_on_self=False)
    assert algo(name, 3, kl_coef=1e-3).passes == dataclasses.replace(passes, reference_on_self=True)
    assert a.needs_peers and a.alone_method == "grpo"  # every one reads the peers' rewards at least
    assert a.cross_centers(None) is None and a.cross_clipped(-0.5, 1.0) is None  # no HACPO window
    assert not a.uses_adaptive_window
    assert algo(name, 3, cross_clip_mode="decoupled").passes == a.passes  # HACPO's switch: not theirs


def test_only_sgt_leaves_responses_out_of_the_batch():
    rewards = torch.ones(2, 2, 3)
    for name in ("mutual_prp", "mutual_xgrpo", "ftis", "hacpo", "grpo"):
        assert algo(name).trains_on(rewards, 0) is None
    assert algo("mutual_sgt").trains_on(rewards, 0).shape == (2, 2, 3)


def test_a_job_falls_back_to_grpo_when_a_peer_is_missing():
    cfg = HACPOConfig(algorithm="mutual_xgrpo")
    jobs = SimpleNamespace(_alone={}, exp=SimpleNamespace(hacpo=cfg), agents=[0, 1])
    xgrpo = algo("mutual_xgrpo")
    assert PeerExchange.step_algorithm(jobs, xgrpo, []) is xgrpo
    alone = PeerExchange.step_algorithm(jobs, xgrpo, ["b"])
    assert alone.name == "grpo" and alone.sources(0) == [0]
    assert PeerExchange.step_algorithm(jobs, algo("mutual_sgt"), ["b"]) is alone  # built once per fallback
    gspo = PeerExchange.step_algorithm(jobs, algo("hacpo"), ["b"])
    assert gspo.name == "gspo" and gspo.sources(0) == [0]  # the sequence-level ones: GSPO
    assert PeerExchange.step_algorithm(jobs, algo("naive"), ["b"]) is gspo
    assert PeerExchange.step_algorithm(jobs, algo("grpo"), ["b"]).name == "grpo"  # alone anyway


# ---- advantages by hand -------------------------------------------------------------------------------
# two prompts, two agents, G = 2 (float64, so the only rounding is that of the formula itself)
REWARDS = torch.tensor([[[1.0, 0.0], [1.0, 1.0]],    # prompt 0: learner 0 solves one, agent 1 both
                        [[0.0, 0.0], [1.0, 0.0]]],   # prompt 1: learner 0 solves none, agent 1 one
                       dtype=torch.float64)
OMEGA = torch.tensor([[1.0, 2.0], [0.5, 1.0]], dtype=torch.float64)  # unread by all four methods


def test_pooled_advantages_of_prp_and_ftis_by_hand():
    # prompt 0 pools (1, 0, 1, 1): μ = 0.75, unbiased var = (3·0.0625 + 0.5625)/3 = 0.25, σ = 0.5
    # prompt 1 pools (0, 0, 1, 0): μ = 0.25, the same σ = 0.5
    want = torch.tensor([[[0.25, -0.75], [0.25, 0.25]], [[-0.25, -0.25], [0.75, -0.25]]], dtype=torch.float64)
    want = want / (0.5 + EPS)
    for name in ("mutual_prp", "ftis"):
        for learner in (0, 1):  # the pooled group is the same for every learner; ω is not used
            torch.testing.assert_close(algo(name).advantages(REWARDS, learner, OMEGA), want, **R12)


def test_xgrpo_scores_the_learners_own_responses_against_the_pooled_group():
    a = algo("mutual_xgrpo")
    want0 = torch.tensor([[[0.25, -0.75]], [[-0.25, -0.25]]], dtype=torch.float64) / (0.5 + EPS)
    torch.testing.assert_close(a.advantages(REWARDS, 0, OMEGA), want0, **R12)
    want1 = torch.tensor([[[0.25, 0.25]], [[0.75, -0.25]]], dtype=torch.float64) / (0.5 + EPS)
    torch.testing.assert_close(a.advantages(REWARDS, 1, OMEGA), want1, **R12)
    # where GRPO alone gives learner 0 nothing on prompt 1 (its group is uniform), XGRPO pushes its two
    # failures down because a peer solved the prompt: the baseline moved, the support did not
    assert algo("grpo").advantages(REWARDS, 0, OMEGA)[1].abs().max() == 0
    assert (a.advantages(REWARDS, 0, OMEGA)[1] < 0).all()


def test_sgt_advantages_and_rescue_set_by_hand():
    a = algo("mutual_sgt", sgt_coef=0.75)
    own = 0.5 / (0.5 ** 0.5 + EPS)  # GRPO within learner 0's (1, 0): μ = 0.5, σ = sqrt(0.5)
    # learner 0: prompt 0 has an own success (no rescue); prompt 1 has none, so agent 1's success transfers
    want0 = torch.tensor([[[own, -own], [0.0, 0.0]], [[0.0, 0.0], [0.75, 0.0]]], dtype=torch.float64)
    torch.testing.assert_close(a.advantages(REWARDS, 0, OMEGA), want0, **R12)
    keep0 = torch.tensor([[[True, True], [False, False]], [[True, True], [True, False]]])
    assert torch.equal(a.trains_on(REWARDS, 0), keep0)
    # learner 1 succeeds on both prompts: nothing is rescued; prompt 0's own (1, 1) is uniform → 0
    want1 = torch.tensor([[[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [own, -own]]], dtype=torch.float64)
    torch.testing.assert_close(a.advantages(REWARDS, 1, OMEGA), want1, **R12)
    assert torch.equal(a.trains_on(REWARDS, 1), torch.tensor([[[False, False], [True, True]]] * 2))


def test_sgt_success_threshold_decides_what_is_verified():
    partial = torch.tensor([[[0.5, 0.0], [1.0, 0.5]]])
    # threshold 1: learner 0's 0.5 is no success, so the prompt is rescued and only the peer's 1.0 transfers
    assert sgt_transfer_mask(partial, 0, 1.0).tolist() == [[[False, False], [True, False]]]
    # threshold 0.5: learner 0 succeeded, nothing transfers
    assert not sgt_transfer_mask(partial, 0, 0.5).any()
    with pytest.raises(ValueError, match=r"\[P, n, G\]"):
        sgt_transfer_mask(partial[0], 0, 1.0)


# ---- peer weights by hand --------------------------------------------------------------------------
LOG_S = [0.0, math.log(0.5), math.log(3.0), math.log(1.5), -2.0, -2.0]
ADV = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
OWN = torch.tensor([True, False, False, False, False, False])


def test_prp_weights_are_the_density_ratio_truncated_at_its_cap():
    log_s = torch.tensor(LOG_S, dtype=torch.float64)
    w, metrics = peer_weights("mutual_prp", log_s, ADV, OWN, HACPOConfig())
    torch.testing.assert_close(w, torch.tensor([1.0, 0.5, 3.0, 1.5, math.exp(-2), math.exp(-2)],
                                               dtype=torch.float64), **R12)
    assert metrics["peer_truncfrac"] == 0.0
    assert metrics["peer_weight_mean"] == pytest.approx((0.5 + 3.0 + 1.5 + 2 * math.exp(-2)) / 5, rel=1e-12)
    w, metrics = peer_weights("mutual_prp", log_s, ADV, OWN, HACPOConfig(prp_max_weight=2.0))
    assert w[2] == 2.0 and metrics["peer_truncfrac"] == 1 / 5


def test_ftis_weights_truncate_at_c_and_filter_far_negative_samples():
    log_s = torch.tensor(LOG_S, dtype=torch.float64)
    w, metrics = peer_weights("ftis", log_s, ADV, OWN, HACPOConfig(ftis_truncation=2.0, ftis_kl_threshold=1.0))
    # 3 → truncated at C = 2; row 4: A < 0 and −log s_old = 2 > δ = 1 → filtered; row 5: the same divergence
    # with A > 0 is kept (filtering is for negative samples only)
    torch.testing.assert_close(w, torch.tensor([1.0, 0.5, 2.0, 1.5, 0.0, math.exp(-2)], dtype=torch.float64), **R12)
    assert metrics["peer_truncfrac"] == 1 / 5 and metrics["peer_filtered_frac"] == 1 / 5
    w, metrics = peer_weights("ftis", log_s, ADV, OWN, HACPOConfig(ftis_kl_threshold=2.5))  # δ above the 2 nats
    assert w[4] == pytest.approx(math.exp(-2), rel=1e-12) and metrics["peer_filtered_frac"] == 0.0
    w, _ = peer_weights("mutual_sgt", log_s, ADV, OWN, HACPOConfig())
    assert torch.equal(w, torch.ones(6, dtype=torch.float64))
    with pytest.raises(ValueError, match="has no peer weight"):
        peer_weights("hacpo", log_s, ADV, OWN, HACPOConfig())


# ---- the loss by hand ---------------------------------------------------------------------------------
def hand_case():
    """One own response (3 tokens, A = 2) and one peer response (2 learner tokens, A = −1, w = 0.5)."""
    out = out_of([-1.0, -2.0, -0.5, -1.2, -1.8], [3, 2])
    inputs = LossInputs(
        advantages=torch.tensor([2.0, -1.0], dtype=torch.float64), is_self=torch.tensor([True, False]),
        discrepancy=torch.ones(2, dtype=torch.float64), source_logp_sum=torch.tensor([-3.5, -4.0], dtype=torch.float64),
        source_len=torch.tensor([3, 4]),
        old_token_logp=torch.tensor([[-1.0, -2.1, -0.4], [0.0, 0.0, 0.0]], dtype=torch.float64),
        learner_old_logp_sum=torch.tensor([-3.5, -3.2], dtype=torch.float64))
    return out, inputs, torch.tensor([1.0, 0.5], dtype=torch.float64)


def test_peer_token_loss_by_hand():
    out, inputs, weight = hand_case()
    loss, metrics = peer_token_loss(out, inputs, weight, HACPOConfig(), num_tokens=5)
    # own: r = (1, e^0.1, e^−0.1), all inside [0.8, 1.28]: Σ J_t = 2·(1 + e^0.1 + e^−0.1)
    # peer: log ρ = (−3.0 − (−3.2))/2 = 0.1 inside the window, A < 0: J = −e^0.1; L_k·w·J = 2·0.5·(−e^0.1)
    e = math.exp(0.1)
    assert float(loss.detach()) == pytest.approx(-(2 * (1 + e + 1 / e) - e) / 5, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, out.token_logps)
    # own tokens: −A·r_t/N; peer tokens: −w·A·ρ/N each (∂ρ/∂token = ρ/L_k, times the L_k factor)
    want = [-2 * 1 / 5, -2 * e / 5, -2 / e / 5, 0.5 * e / 5, 0.5 * e / 5]
    torch.testing.assert_close(grad, torch.tensor(want, dtype=torch.float64), **R12)
    # s at π_θ (eq. 11): −3.0/2 − (−4.0/4) = −0.5
    assert metrics["cross_ratio_mean"] == pytest.approx(math.exp(-0.5), rel=1e-12)
    assert (metrics["num_self"], metrics["num_cross"], metrics["token_clipfrac"], metrics["cross_clipfrac"]) == (
        1.0, 1.0, 0.0, 0.0)


def test_without_peer_rows_the_loss_is_grpos():
    out, inputs, weight = hand_case()
    own = inputs.select(torch.tensor([0]))
    own_out = out_of([-1.0, -2.0, -0.5], [3])
    loss, _ = peer_token_loss(own_out, own, weight[:1], HACPOConfig(), num_tokens=7)
    want, _ = grpo_token_loss(own_out.token_logps, own.old_token_logp[0], torch.full((3,), 2.0, dtype=torch.float64),
                              num_tokens=7)
    assert torch.equal(loss, want)  # the same terms summed in the same order, plus an empty peer sum


def test_the_clip_leaves_no_gradient_on_the_bounds_side():
    # own tokens at r = e^0.3 > 1.28: A > 0 no gradient, A < 0 full gradient; a peer at ρ = e^0.3 likewise
    out = out_of([0.0, 0.0, 0.0, 0.0], [1, 1, 1, 1])
    inputs = LossInputs(
        advantages=torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64),
        is_self=torch.tensor([True, True, False, False]), discrepancy=torch.ones(4, dtype=torch.float64),
        source_logp_sum=torch.zeros(4, dtype=torch.float64), source_len=torch.ones(4, dtype=torch.long),
        old_token_logp=torch.full((4, 1), -0.3, dtype=torch.float64),
        learner_old_logp_sum=torch.full((4,), -0.3, dtype=torch.float64))
    loss, metrics = peer_token_loss(out, inputs, torch.ones(4, dtype=torch.float64), HACPOConfig(), num_tokens=4)
    (grad,) = torch.autograd.grad(loss, out.token_logps)
    r = math.exp(0.3)
    torch.testing.assert_close(grad, torch.tensor([0.0, r / 4, 0.0, r / 4], dtype=torch.float64), **R12)
    assert metrics["token_clipfrac"] == 0.5 and metrics["cross_clipfrac"] == 0.5


def test_loss_names_what_is_missing():
    out, inputs, weight = hand_case()
    with pytest.raises(ValueError, match="old_token_logp"):
        peer_token_loss(out, dataclasses.replace(inputs, old_token_logp=None), weight, HACPOConfig())
    with pytest.raises(ValueError, match="learner_old_logp_sum"):
        peer_token_loss(out, dataclasses.replace(inputs, learner_old_logp_sum=None), weight, HACPOConfig())
    with pytest.raises(ValueError, match="learner_old_logp_sum"):
        algo("ftis").loss_fn(["a", "b"])(out, dataclasses.replace(inputs, learner_old_logp_sum=None), info(5))
    with pytest.raises(ValueError, match="loss_inputs"):
        algo("mutual_sgt").loss_fn(["a", "b"])(out, None, info(5))


# ---- gradient directions through each method's loss_fn ------------------------------------------------
# rows: own (A = 0.5); peers: A < 0 far off (−log s_old = 2), A < 0 near (−0.5), A > 0 liked (log s_old = 1.5),
# A > 0 far off (−2). One token each, at the first update (r = ρ = 1), N = 5 tokens.
ROWS = dict(logps=[-1.0, -1.1, -1.2, -1.3, -1.4], adv=[0.5, -1.0, -1.0, 1.0, 1.0],
            own=[True, False, False, False, False], log_s_old=[0.0, -2.0, -0.5, 1.5, -2.0])


def test_ftis_drops_filtered_samples_and_truncates_at_c():
    inputs = one_token_inputs(**ROWS)
    grad = token_grads("ftis", inputs, ROWS["logps"], ftis_truncation=2.0, ftis_kl_threshold=1.0)
    # −w·A/N: own −0.5/5; filtered 0; near negative +e^−0.5/5 (pushed down); liked: w = C = 2 (not e^1.5);
    # far positive: kept at w = e^−2
    want = [-0.5 / 5, 0.0, math.exp(-0.5) / 5, -2.0 / 5, -math.exp(-2) / 5]
    torch.testing.assert_close(grad, torch.tensor(want, dtype=torch.float64), **R12)
    # PRP on the same rows: nothing filtered, the weight capped only at prp_max_weight = 10
    grad = token_grads("mutual_prp", inputs, ROWS["logps"])
    want = [-0.5 / 5, math.exp(-2) / 5, math.exp(-0.5) / 5, -math.exp(1.5) / 5, -math.exp(-2) / 5]
    torch.testing.assert_close(grad, torch.tensor(want, dtype=torch.float64), **R12)
    # SGT's peer rows have weight 1 whatever s_old is
    grad = token_grads("mutual_sgt", inputs, ROWS["logps"])
    torch.testing.assert_close(grad, torch.tensor([-0.5, 1.0, 1.0, -1.0, -1.0], dtype=torch.float64) / 5, **R12)


def sgt_batch(rewards: torch.Tensor, learner: int, **fields) -> tuple[torch.Tensor, LossInputs, list[tuple]]:
    """Learner k's SGT rows as learner_batch builds them (sources in config order, prompt-major), one token each."""
    a = algo("mutual_sgt", **fields)
    adv, keep = a.advantages(rewards, learner, OMEGA), a.trains_on(rewards, learner)
    labels = [(j, p, i) for j in range(rewards.shape[1]) for p in range(rewards.shape[0]) for i in range(rewards.shape[2])]
    rows = [lab for lab in labels if keep[lab[1], lab[0], lab[2]]]
    inputs = one_token_inputs([-1.0] * len(rows), [float(adv[p, j, i]) for j, p, i in rows],
                              [j == learner for j, _, _ in rows], [0.0] * len(rows))
    grad = token_grads("mutual_sgt", inputs, [-1.0] * len(rows), **fields)
    return grad, inputs, rows


def test_sgt_moves_only_toward_peer_successes_on_the_rescue_set():
    rewards = torch.tensor([[[0.0, 0.0], [1.0, 0.0]],   # prompt 0: learner 0 fails both → rescued
                            [[1.0, 0.0], [1.0, 1.0]]],  # prompt 1: learner 0 solved one → no transfer
                           dtype=torch.float64)
    grad, _, rows = sgt_batch(rewards, 0)
    # the batch: learner 0's four responses and agent 1's success on prompt 0, nothing else of agent 1
    assert rows == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0)]
    n = len(rows)
    own = 0.5 / (0.5 ** 0.5 + EPS)
    # prompt 0's own failures: A = 0 (GRPO has nothing there); prompt 1's own pair ±; the transferred success:
    # −λ/N < 0, so a descent step raises the learner's log-probability of the peer's verified answer
    want = [0.0, 0.0, -own / n, own / n, -1.0 / n]
    torch.testing.assert_close(grad, torch.tensor(want, dtype=torch.float64), **R12)
    grad2, _, _ = sgt_batch(rewards, 0, sgt_coef=2.0)
    assert float(grad2[-1]) == pytest.approx(2 * float(grad[-1]), rel=1e-12)  # λ scales the transfer, and only it
    torch.testing.assert_close(grad2[:-1], grad[:-1], **R12)
    # learner 1 succeeded everywhere: no rescue, its batch is its own four responses (GRPO alone)
    _, inputs1, rows1 = sgt_batch(rewards, 1)
    assert all(j == 1 for j, _, _ in rows1) and bool(inputs1.is_self.all())


# ---- config ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("hacpo.prp_max_weight=0", r"hacpo\.prp_max_weight=0(\.0)?: must be > 0"),
    ("hacpo.ftis_truncation=-1", r"hacpo\.ftis_truncation=-1(\.0)?: must be > 0"),
    ("hacpo.ftis_kl_threshold=-0.5", r"hacpo\.ftis_kl_threshold=-0\.5: must be >= 0"),
    ("hacpo.ftis_kl_threshold=.nan", r"hacpo\.ftis_kl_threshold=nan: must be a finite number"),
    ("hacpo.sgt_coef=200", r"hacpo\.sgt_coef=200(\.0)?: must be <= 100"),
    ("hacpo.sgt_success_threshold=0", r"hacpo\.sgt_success_threshold=0(\.0)?: must be > 0"),
    ("hacpo.sgt_success_threshold=2", r"hacpo\.sgt_success_threshold=2(\.0)?: must be <= hacpo\.max_reward=1"),
    ("hacpo.algorithm=mutual_grpo", r"hacpo\.algorithm='mutual_grpo': must be one of"),
])
def test_config_rejects_bad_peer_settings_naming_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("cpu_demo", [override])


@pytest.mark.parametrize("name", PEER_METHODS)
def test_config_accepts_each_method_and_its_rules(name):
    assert load_config("cpu_demo", [f"hacpo.algorithm={name}"]).hacpo.algorithm == name
    with pytest.raises(ConfigError, match=f"hacpo.algorithm='{name}': shares rollouts .* needs >= 2 agents"):
        load_config("cpu_demo", [f"hacpo.algorithm={name}", "agents=[{name: solo}]"])
    with pytest.raises(ConfigError, match=f"hacpo.algorithm={name} is token-level"):
        load_config("cpu_demo", [f"hacpo.algorithm={name}", "train.rollout_mode=one_step_off"])


# ---- one training step of each through the real loop -------------------------------------------------
class FirstAgentFails(VerifierPool):
    """The parity verifier, but every response of the first agent (config order) scores 0: the loop verifies
    all agents' responses in one call, agent by agent."""

    def score(self, requests):
        scores = super().score(requests)
        half = len(scores) // 2
        return [0.0] * half + scores[half:]


def one_step(tmp_path, name, verifier, monkeypatch):
    exp = tiny_exp(tmp_path, name)
    run = loop.setup(exp)
    run.verifier.close()
    run.verifier = verifier
    batches = {}
    real = stages.learner_batch

    def recording(rt, *args, **kwargs):
        batches[rt.name] = batch = real(rt, *args, **kwargs)
        return batch

    monkeypatch.setattr(stages, "learner_batch", recording)
    before = {rt.name: exported(rt) for rt in run.runtimes}
    metrics = loop.train_step(run)
    changed = {rt.name: [k for k, v in exported(rt).items() if not torch.equal(v, before[rt.name][k])]
               for rt in run.runtimes}
    return exp, run, metrics, batches, changed


@pytest.mark.parametrize("name", PEER_METHODS)
def test_one_training_step_of_each_method(tmp_path, monkeypatch, name):
    exp, run, metrics, batches, changed = one_step(tmp_path, name, VerifierPool(num_workers=0, score_fn=parity_reward),
                                                   monkeypatch)
    own = exp.train.prompts_per_step * exp.rollout.samples_per_prompt
    for rt in run.runtimes:
        total = len(list(rt.trainer.export_hf_weights()))
        assert len(changed[rt.name]) == total, f"{rt.name}: only {len(changed[rt.name])} of {total} tensors changed"
        assert math.isfinite(metrics[f"{rt.name}/hacpo/loss"])
        inputs = batches[rt.name].loss_inputs
        if name == "mutual_xgrpo":  # its own responses only
            assert metrics[f"{rt.name}/sequences"] == own and bool(inputs.is_self.all())
        elif name in ("mutual_prp", "ftis"):  # everyone's responses
            assert metrics[f"{rt.name}/sequences"] == 2 * own
            assert metrics[f"{rt.name}/hacpo/num_cross"] > 0 and metrics[f"{rt.name}/hacpo/peer_weight_mean"] > 0
            # a cross row has no per-token π_old in the learner's tokens: zeros, never read
            assert not inputs.old_token_logp[~inputs.is_self].any()
        if name == "ftis":
            assert 0.0 <= metrics[f"{rt.name}/hacpo/peer_filtered_frac"] <= 1.0


def test_sgt_trains_a_learner_that_fails_everything_on_its_peers_successes(tmp_path, monkeypatch):
    """llama scores 0 on every response, so GRPO alone would give it no gradient at all: every prompt is in its
    rescue set and all it learns from are qwen3's verified successes. qwen3 has nothing to be rescued by."""
    exp, run, metrics, batches, changed = one_step(tmp_path, "mutual_sgt", FirstAgentFails(num_workers=0,
                                                   score_fn=parity_reward), monkeypatch)
    own = exp.train.prompts_per_step * exp.rollout.samples_per_prompt
    llama = batches["llama"].loss_inputs
    peers = ~llama.is_self
    assert int(peers.sum()) > 0 and metrics["llama/sequences"] == own + int(peers.sum())
    assert torch.equal(llama.advantages[peers], torch.ones(int(peers.sum())))  # λ = 1 on each transfer
    assert not llama.advantages[llama.is_self].any()  # its own groups are uniform: A = 0
    assert changed["llama"], "llama did not move: the transferred successes gave no gradient"
    assert metrics["qwen3/sequences"] == own and bool(batches["qwen3"].loss_inputs.is_self.all())
    assert math.isfinite(metrics["llama/hacpo/loss"]) and math.isfinite(metrics["qwen3/hacpo/loss"])
