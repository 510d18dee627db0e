"""Other ways to share rollouts between heterogeneous agents, as pure tensor functions (docs/algorithm.md §8a):
the three probes of Mutual RL (Liu, Ram et al., arXiv 2605.07244) and F-TIS (arXiv 2605.22537).

All four sit on GRPO (§8): the learner's **own** responses train with GRPO's token-level clipped objective on
its own per-token π_old. They differ in what the other agents contribute:

* ``mutual_prp`` (Peer Rollout Pooling, data level): peers' responses join the learner's batch and its group;
  A = (R − mean) / std over the pooled n·G rewards; each peer response is weighted by its density ratio
  w = min(s_old, C_prp).
* ``mutual_xgrpo`` (Cross-Policy GRPO Advantage Sharing, value level): the learner trains on its own responses
  only, with A = (R − mean) / std of the pooled n·G rewards (:func:`pooled_own_advantages`).
* ``mutual_sgt`` (Success-Gated Transfer, outcome level): GRPO on the learner's own group; for a prompt where
  none of the learner's own responses succeeds (its rescue set) every verified peer success joins with
  advantage λ, weight 1 (:func:`sgt_transfer_mask`, :func:`sgt_advantages`); other peer responses stay out.
* ``ftis`` (Filtered Truncated Importance Sampling): peers' responses join as in PRP with the truncated weight
  min(s_old, C); a peer response with A < 0 whose per-token divergence −log s_old exceeds δ is dropped
  (:func:`peer_weights`).

A peer's response ỹ is re-tokenized into the learner's tokens (§6), so no per-token ratio to its author
exists. Every quantity that crosses agents is the per-token-normalised sequence ratio of eq. 11, evaluated
at the learner's π_old (a constant of the step):

    log s_old = (1/L_k)·Σ_t log π^(k)_old(ỹ_t) − (1/L_j)·Σ_t log π^(j)_old(y_t),

and the trust region of a peer response is the learner's own sequence-level proximal ratio (as §5d)

    log ρ = (1/L_k)·Σ_t [log π^(k)_θ(ỹ_t) − log π^(k)_old(ỹ_t)]      (ρ = 1 exactly at the first update).

The loss of a mini-batch (:func:`peer_token_loss`) keeps GRPO's token-mean aggregation over its N global
response tokens (learner tokens, peers' included):

    loss = −(1/N)·[ Σ_{own tokens t} min(r_t·A, clip(r_t, 1 − ε_low, 1 + ε_high)·A)
                  + Σ_{peer sequences} L_k · w · min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A) ],

r_t = π_θ(y_t)/π_old(y_t), ε of ``hacpo.grpo_clip_*``. The factor L_k makes a peer sequence weigh as its
L_k tokens would: at ρ = 1 its gradient is w·A·Σ_t ∇log π^(k)_θ(ỹ_t), exactly GRPO's for a response of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from hacrl_megatron.algo.advantages import capability_aware_advantages
from hacrl_megatron.algo.grpo import broadcast_to_tokens
from hacrl_megatron.algo.hacpo import sequence_log_ratio
from hacrl_megatron.algo.inputs import LossInputs
from hacrl_megatron.config import HACPOConfig

PEER_WEIGHTED = ("mutual_prp", "ftis")  # methods that weight a peer response by its (truncated) density ratio


def _pooled(rewards: torch.Tensor, cfg: HACPOConfig) -> torch.Tensor:
    """A [P, n, G]: every response against the plain mean and unbiased std of the prompt's n·G rewards (ω ≡ 1)."""
    n = rewards.shape[1]
    return capability_aware_advantages(rewards, 0, torch.ones(n, n, dtype=torch.float64), capability_aware=False,
                                       uniform_guard=cfg.uniform_guard, baseline_guard=cfg.baseline_guard,
                                       max_reward=cfg.max_reward)


def pooled_advantages(rewards: torch.Tensor, cfg: HACPOConfig) -> torch.Tensor:
    """PRP's and F-TIS's A [P, n, G] (every agent's responses, the learner's batch): the pooled GRPO advantage
    (R − μ)/(σ + eps), μ and σ (unbiased) over the prompt's n·G rewards; A = 0 for a uniform prompt
    (``hacpo.uniform_guard``). The same for every learner."""
    return _pooled(rewards, cfg)


def pooled_own_advantages(rewards: torch.Tensor, learner: int, cfg: HACPOConfig) -> torch.Tensor:
    """XGRPO's A [P, 1, G]: the learner's own responses scored against the pooled n·G group's μ and σ."""
    return _pooled(rewards, cfg)[:, learner: learner + 1]


def sgt_transfer_mask(rewards: torch.Tensor, learner: int, threshold: float) -> torch.Tensor:
    """[P, n, G] bool: the peer responses SGT transfers to learner k — successes (R >= ``threshold``) of other
    agents on the prompts of k's rescue set, where none of k's own G responses succeeded. k's own column is False."""
    if rewards.dim() != 3 or not 0 <= learner < rewards.shape[1]:
        raise ValueError(f"rewards must be [P, n, G] with learner in range(n); got {tuple(rewards.shape)}, {learner}")
    success = rewards.to(torch.float64) >= threshold
    rescue = ~success[:, learner].any(dim=1)  # [P]: the learner's own group has no success
    mask = success & rescue.view(-1, 1, 1)
    mask[:, learner] = False
    return mask


def sgt_advantages(rewards: torch.Tensor, learner: int, cfg: HACPOConfig) -> torch.Tensor:
    """SGT's A [P, n, G] in the dtype of ``rewards``: GRPO's advantage within the learner's own G responses in its
    column; λ (``hacpo.sgt_coef``) on the transferred peer successes (:func:`sgt_transfer_mask`); 0 elsewhere."""
    own = capability_aware_advantages(rewards[:, learner: learner + 1], 0, torch.ones(1, 1, dtype=torch.float64),
                                      capability_aware=False, uniform_guard=cfg.uniform_guard,
                                      baseline_guard=cfg.baseline_guard, max_reward=cfg.max_reward)
    out = torch.where(sgt_transfer_mask(rewards, learner, cfg.sgt_success_threshold),
                      torch.tensor(cfg.sgt_coef, dtype=own.dtype), torch.zeros((), dtype=own.dtype))
    out[:, learner] = own[:, 0]
    return out


def peer_weights(algorithm: str, old_log_ratio: torch.Tensor, advantages: torch.Tensor, is_self: torch.Tensor,
                 cfg: HACPOConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """w [S] (constants, 1 on own rows) of each peer sequence, and the metrics over the peer sequences.

    ``old_log_ratio``: [S] log s_old (0 on own rows). ``mutual_prp``: w = min(s_old, ``prp_max_weight``);
    ``ftis``: w = min(s_old, ``ftis_truncation``), and 0 where A < 0 and −log s_old > ``ftis_kl_threshold``
    (filtered); ``mutual_sgt``: w = 1 (no metrics). Metrics of PRP and F-TIS: ``peer_weight_mean`` and
    ``peer_truncfrac`` (share with s_old above the cap), of F-TIS also ``peer_filtered_frac``; each 0 without
    peer sequences.
    """
    log_s = old_log_ratio.detach().to(torch.float64)
    own = is_self.bool()
    metrics: dict[str, float] = {}
    if algorithm in PEER_WEIGHTED:
        cap = cfg.prp_max_weight if algorithm == "mutual_prp" else cfg.ftis_truncation
        weight = torch.exp(log_s).clamp(max=cap)
        truncated = log_s.exp() > cap
        metrics["peer_truncfrac"] = _share(truncated, ~own)
        if algorithm == "ftis":
            # −log s_old = mean_t log π_gen − mean_t log π_learner: the k1 estimate of KL(π_gen ‖ π_learner) per
            # token; a wrong answer the learner is far less likely to write than its author is noise, not signal
            filtered = ~own & (advantages.detach() < 0) & (-log_s > cfg.ftis_kl_threshold)
            weight = torch.where(filtered, torch.zeros_like(weight), weight)
            metrics["peer_filtered_frac"] = _share(filtered, ~own)
        weight = torch.where(own, torch.ones_like(weight), weight)
        metrics["peer_weight_mean"] = float(weight[~own].mean()) if bool((~own).any()) else 0.0
        return weight, metrics
    if algorithm == "mutual_sgt":
        return torch.ones_like(log_s), metrics
    raise ValueError(f"peer_weights: hacpo.algorithm={algorithm!r} has no peer weight")


def _share(mask: torch.Tensor, within: torch.Tensor) -> float:
    count = int(within.sum())
    return float((mask & within).sum()) / count if count else 0.0


def _clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.minimum(ratio * adv, ratio.clamp(1.0 - low, 1.0 + high) * adv)


def _zero_grad(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Where PPO's min() leaves no gradient: above the window with A > 0, below it with A < 0."""
    return ((adv > 0) & (ratio > 1.0 + high)) | ((adv < 0) & (ratio < 1.0 - low))


def peer_token_loss(out: Any, inputs: LossInputs, weight: torch.Tensor, cfg: HACPOConfig,
                    num_tokens: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """−(own tokens' GRPO terms + Σ_peer L_k·w·J_seq) / N and metrics (the module docstring's loss).

    Args:
        out: the learner's log-probs of S sequences (``agents.batch.LogProbOutput``): ``token_logps`` [N]
            (differentiable), ``cu_seqlens`` [S + 1], ``seq_logp_sum`` [S] (differentiable), ``seq_len`` [S].
        inputs: the sequences' :class:`LossInputs`; needs ``old_token_logp`` (own rows: the learner's per-token
            π_old; peer rows unread) and, with peer rows, ``learner_old_logp_sum`` (Σ log π^(k)_old in the
            learner's tokens).
        weight: [S] w of each peer sequence (:func:`peer_weights`; own rows unread), a constant.
        num_tokens: the mini-batch's global response-token count N (defaults to this call's N).

    Metrics: GRPO's ``token_ratio_mean`` and ``token_clipfrac`` over own tokens; ``adv_abs_mean`` over the
    sequences; ``num_self``, ``num_cross``; ``cross_ratio_*`` (s of eq. 11 at π_θ) and ``cross_clipfrac``
    (share of peer sequences with A ≠ 0 whose clip of ρ leaves no gradient).
    """
    if len(inputs) != out.seq_len.numel():
        raise ValueError(f"peer_token_loss: inputs hold {len(inputs)} sequences, the log-probs {out.seq_len.numel()}")
    device = out.token_logps.device
    dtype = torch.promote_types(out.token_logps.dtype, torch.float32)
    own = inputs.is_self.to(device).bool()
    adv = inputs.advantages.to(device=device, dtype=dtype)
    lengths = out.seq_len.to(device)
    low, high = cfg.grpo_clip_low, cfg.grpo_clip_high
    # own responses: GRPO's token terms on the learner's own per-token π_old (algo/grpo.py)
    rows = torch.nonzero(own).flatten().tolist()
    if rows and inputs.old_token_logp is None:
        raise ValueError("the learner's own responses need LossInputs.old_token_logp (their per-token log π_old, "
                         "StepPasses.source_token_logps)")
    sizes = out.seq_len.tolist()
    old = (torch.cat([inputs.old_token_logp[i, :sizes[i]] for i in rows]).to(device=device, dtype=dtype) if rows
           else out.token_logps.new_zeros(0, dtype=dtype))
    on_own = broadcast_to_tokens(own.to(torch.int8), out.cu_seqlens.to(device)).bool()
    token_adv = broadcast_to_tokens(adv, out.cu_seqlens.to(device))[on_own]
    token_ratio = torch.exp((out.token_logps[on_own].to(dtype) - old).clamp(-20.0, 20.0))
    token_j = _clipped_objective(token_ratio, token_adv, low, high)
    # peer responses: one sequence term each, in the learner's tokens, weighted by its L_k tokens
    peer = ~own
    if bool(peer.any()) and inputs.learner_old_logp_sum is None:
        raise ValueError("peer responses need LossInputs.learner_old_logp_sum (the learner's Σ log π_old over them, "
                         "StepPasses.learner_old_on_others)")
    learner_old = (inputs.learner_old_logp_sum.to(device=device, dtype=dtype) if inputs.learner_old_logp_sum
                   is not None else out.seq_logp_sum.detach().to(dtype))
    lens = lengths.clamp(min=1).to(dtype)
    log_rho = ((out.seq_logp_sum.to(dtype) - learner_old) / lens).clamp(-cfg.max_abs_log_ratio, cfg.max_abs_log_ratio)
    rho = torch.exp(log_rho)
    seq_j = _clipped_objective(rho, adv, low, high) * weight.detach().to(device=device, dtype=dtype)
    peer_sum = (lens * seq_j)[peer].sum()
    denom = out.token_logps.numel() if num_tokens is None else num_tokens
    loss = -(token_j.sum() + peer_sum) / max(denom, 1)
    with torch.no_grad():
        metrics = {
            "token_ratio_mean": float(token_ratio.mean()) if token_ratio.numel() else 0.0,
            "token_clipfrac": float((_clipped_objective(token_ratio, token_adv, low, high)
                                     < token_ratio * token_adv).float().mean()) if token_ratio.numel() else 0.0,
            "adv_abs_mean": float(adv.abs().mean()) if adv.numel() else 0.0,
            "num_self": float(own.sum()), "num_cross": float(peer.sum()),
        }
        if bool(peer.any()):
            s = torch.exp(sequence_log_ratio(out.seq_logp_sum.detach(), lengths, inputs.source_logp_sum.to(device),
                                             inputs.source_len.to(device), cfg.max_abs_log_ratio)[peer].double())
            metrics.update(cross_ratio_mean=float(s.mean()), cross_ratio_min=float(s.min()),
                           cross_ratio_max=float(s.max()),
                           cross_clipfrac=_share(_zero_grad(rho.detach(), adv, low, high)[peer], adv[peer] != 0))
    return loss, metrics


def old_log_ratio(out: Any, inputs: LossInputs, cfg: HACPOConfig) -> torch.Tensor:
    """log s_old [S] (float64, 0 on own rows): eq. 11 at the learner's π_old, from ``learner_old_logp_sum``."""
    own = inputs.is_self.bool()
    if inputs.learner_old_logp_sum is None:
        if bool((~own).any()):
            raise ValueError("peer responses need LossInputs.learner_old_logp_sum (StepPasses.learner_old_on_others)")
        return torch.zeros(len(inputs), dtype=torch.float64)
    lengths = out.seq_len.to(inputs.source_len.device)
    log_s = sequence_log_ratio(inputs.learner_old_logp_sum.double(), lengths, inputs.source_logp_sum.double(),
                               inputs.source_len, cfg.max_abs_log_ratio)
    return torch.where(own, torch.zeros_like(log_s), log_s)
