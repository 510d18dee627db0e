"""Sequence ratios and the HACPO objective (docs/algorithm.md §3-5, §7-8; paper eq. 10-14, 50).

Per sequence y of source agent j, seen by learner k:

* log s = (1/L_k)·Σ log π^(k)_θ(ỹ) − (1/L_j)·Σ log π^(j)_old(y), clamped to ±10 (eq. 11);
* self (j = k):  J = min(s·A, clip(s, 1 − ε_low, 1 + ε_high)·A)                       (GSPO);
* cross (j ≠ k): J = s_c · sg[s_c]^α · ω^(j,k) · A,  s_c = clamp(s, lb_m, 1),
  lb_m = min(1, (1 − δ) + m·δ_step)                                               (eq. 12-14);
  ``cross_clip_mode=pessimistic``: J = min(s·A, s_c·A) · sg[s_c]^α · ω^(j,k)          (§5a);
  ``cross_clip_mode=gspo``: the same bound on GSPO's window [1 − ε_low, 1 + ε_high]     (§5c);
  ``cross_clip_mode=decoupled``: J = min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A) · w^(1+α) · ω^(j,k),
  r = π^(k)_θ/π^(k)_old (the learner's own old policy), w = min(1, s at π^(k)_old), a constant (§5d);
  ``cross_window=adaptive``: s is first divided by e^c, c the pair's centre         (§5b).

The loss is −Σ J / (global number of sequences of the mini-batch), so summing micro-batch losses
gives exactly the full mini-batch loss and gradient (docs/algorithm.md §7).
"""

from __future__ import annotations

import math

import torch

from hacrl_megatron.algo.inputs import LossInputs
from hacrl_megatron.config import HACPOConfig

SEQUENCE_ALGORITHMS = ("hacpo", "gspo", "gspo_x2", "naive")
GSPO_WINDOW_MODES = ("gspo", "decoupled")  # cross modes on GSPO's self window (docs/algorithm.md §5c-5d)
BOUNDED_MODES = ("pessimistic", "gspo", "decoupled")  # cross modes with PPO's min() bound


def sequence_log_ratio(
    learner_logp_sum: torch.Tensor,
    learner_len: torch.Tensor,
    source_logp_sum: torch.Tensor,
    source_len: torch.Tensor,
    max_abs_log_ratio: float = 10.0,
) -> torch.Tensor:
    """log s^(k,j) per sequence (eq. 11): length-normalised log-prob difference, clamped.

    All inputs are [S]; lengths are token counts (> 0) in each side's own tokenizer. Differentiable
    through ``learner_logp_sum``. Returns [S] in the dtype of ``learner_logp_sum`` (float32 at least).
    """
    shapes = {t.shape for t in (learner_logp_sum, learner_len, source_logp_sum, source_len)}
    if len(shapes) != 1 or learner_logp_sum.dim() != 1:
        raise ValueError(f"sequence_log_ratio expects four [S] tensors, got shapes {sorted(map(tuple, shapes))}")
    if (learner_len <= 0).any() or (source_len <= 0).any():
        raise ValueError("sequence lengths must be > 0 on both sides (an empty response has no ratio)")
    dtype = torch.promote_types(learner_logp_sum.dtype, torch.float32)
    learner_mean = learner_logp_sum.to(dtype) / learner_len.to(dtype)
    source_mean = source_logp_sum.to(dtype) / source_len.to(dtype)
    return (learner_mean - source_mean).clamp(-max_abs_log_ratio, max_abs_log_ratio)


def cross_window(update_index: int, cfg: HACPOConfig) -> tuple[float, float]:
    """The cross clip window [lb_m, 1] at mini-batch update m (eq. 14; static when not stepwise).

    ``cross_clip_mode=gspo`` and ``decoupled`` (docs/algorithm.md §5c-5d): GSPO's self window
    [1 − ε_low, 1 + ε_high] at every m (no stepwise tightening); ``decoupled`` applies it to r, not s.
    """
    if update_index < 0:
        raise ValueError(f"update_index={update_index}: must be >= 0")
    if cfg.cross_clip_mode in GSPO_WINDOW_MODES:
        return 1.0 - cfg.self_clip_low, 1.0 + cfg.self_clip_high
    step = update_index * cfg.delta_step if cfg.stepwise else 0.0
    return min(1.0, cfg.cross_clip_low + step), 1.0


def adaptive_center(median_log_ratio: float | None, cfg: HACPOConfig) -> float:
    """The adaptive window's log-space centre c of one learner-source pair (docs/algorithm.md §5b).

    ``median_log_ratio``: the pair's running median of log s (None: no history yet). c = 0 while the
    median lies inside the initial window [log(1 − δ), 0], so a pair whose ratios sit near 1 keeps
    the paper's window; outside it c = median − ½·log(1 − δ) puts the median at the window's log-centre.
    """
    if median_log_ratio is None or cfg.cross_window == "fixed":
        return 0.0
    low = math.log(cfg.cross_clip_low)
    if low <= median_log_ratio <= 0.0:
        return 0.0
    return float(median_log_ratio - 0.5 * low)


def gspo_objective(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """GSPO's clipped sequence objective min(s·A, clip(s, 1 − ε_low, 1 + ε_high)·A), [S]."""
    return torch.minimum(ratio * advantages, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages)


def _check_inputs(log_ratio: torch.Tensor, advantages: torch.Tensor, is_self: torch.Tensor,
                  discrepancy: torch.Tensor) -> None:
    if log_ratio.dim() != 1:
        raise ValueError(f"log_ratio must be [S], got shape {tuple(log_ratio.shape)}")
    for name, t in (("advantages", advantages), ("is_self", is_self), ("discrepancy", discrepancy)):
        if t.shape != log_ratio.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(log_ratio.shape)} like log_ratio")


def hacpo_sequence_objective(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    is_self: torch.Tensor,
    discrepancy: torch.Tensor,
    update_index: int,
    cfg: HACPOConfig,
    center: torch.Tensor | None = None,
    old_log_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence objective J [S] of docs/algorithm.md §4-5, differentiable through ``log_ratio``.

    Args:
        log_ratio: [S] log s from :func:`sequence_log_ratio`.
        advantages: [S] learner's advantages A^(k) (eq. 7), constants.
        is_self: [S] bool, True where the source agent is the learner.
        discrepancy: [S] ω^(j,k) = clip(P̂_j / P̂_k) for each sequence's source j (1 for self).
        update_index: m, optimizer updates already made by this learner in this step.
        cfg: algorithm and ablation switches (docs/algorithm.md §8). ``naive`` applies GSPO's clip to every
            sequence with no coefficient and α = 0; ``gspo``/``gspo_x2`` treat every sequence as self.
            ``cfg.cross_clip_mode`` picks the cross bound (§5 clamp, §5a pessimistic, §5c gspo, §5d decoupled).
        center: [S] log-space centre c of each sequence's pair (§5b), or None (all 0). The cross term
            uses s̃ = s·e^(−c) in place of s; self sequences ignore it.
        old_log_ratio: [S] constant log s at the learner's old policy, (1/L_k)·Σ log π^(k)_old(ỹ) −
            (1/L_j)·Σ log π^(j)_old(y) (eq. 11 before any update; 0 for self sequences). Required by
            ``cross_clip_mode=decoupled`` (§5d), which splits s into r = e^(log s − old_log_ratio) and
            w = min(1, e^old_log_ratio); ignored by the other modes.
    """
    _check_inputs(log_ratio, advantages, is_self, discrepancy)
    if cfg.algorithm not in SEQUENCE_ALGORITHMS:
        raise ValueError(f"hacpo.algorithm={cfg.algorithm!r} is not a sequence-level objective; "
                         f"use grpo_token_loss for 'grpo'")
    ratio = torch.exp(log_ratio)
    adv = advantages.to(ratio.dtype)
    self_term = gspo_objective(ratio, adv, cfg.self_clip_low, cfg.self_clip_high)
    if cfg.algorithm in ("naive", "gspo", "gspo_x2"):
        return self_term
    coef = discrepancy.to(ratio.dtype) if cfg.discrepancy_coefficient else torch.ones_like(ratio)
    if cfg.cross_clip_mode == "decoupled":
        return torch.where(is_self.bool(), self_term, _decoupled_cross_term(log_ratio, adv, coef, cfg, old_log_ratio))
    cross_ratio = ratio if center is None else torch.exp(log_ratio - center.to(log_ratio.dtype))
    if cfg.cross_clip:
        low, high = cross_window(update_index, cfg)
        clipped = cross_ratio.clamp(low, high)
    else:
        clipped = cross_ratio
    if cfg.cross_clip_mode in BOUNDED_MODES:  # PPO's bound on the mode's window; sg[s_c]^α uses s_c
        cross_term = torch.minimum(cross_ratio * adv, clipped * adv) * clipped.detach().pow(cfg.alpha) * coef
    else:
        cross_term = clipped * clipped.detach().pow(cfg.alpha) * coef * adv
    return torch.where(is_self.bool(), self_term, cross_term)


def _decoupled_cross_term(log_ratio: torch.Tensor, adv: torch.Tensor, coef: torch.Tensor, cfg: HACPOConfig,
                          old_log_ratio: torch.Tensor | None) -> torch.Tensor:
    """J_cross of docs/algorithm.md §5d, [S]: min(r·A, clip(r)·A) · w^(1+α) · ω with the proximal ratio
    r = π^(k)_θ/π^(k)_old (differentiable) and the behaviour weight w = min(1, π^(k)_old/π^(j)_old) (constant)."""
    if old_log_ratio is None:
        raise ValueError("hacpo.cross_clip_mode=decoupled needs old_log_ratio (log s at the learner's old policy, "
                         "from LossInputs.learner_old_logp_sum)")
    if old_log_ratio.shape != log_ratio.shape:
        raise ValueError(f"old_log_ratio has shape {tuple(old_log_ratio.shape)}, expected {tuple(log_ratio.shape)}")
    old = old_log_ratio.detach().to(log_ratio.dtype)
    proximal = torch.exp(log_ratio - old)
    if cfg.cross_clip:
        bounded = torch.minimum(proximal * adv, proximal.clamp(1.0 - cfg.self_clip_low, 1.0 + cfg.self_clip_high) * adv)
    else:
        bounded = proximal * adv
    weight = torch.exp(old).clamp(max=1.0)
    return bounded * weight.pow(1.0 + cfg.alpha) * coef


def _stats(values: torch.Tensor, prefix: str) -> dict[str, float]:
    if values.numel() == 0:
        return {f"{prefix}_mean": 0.0, f"{prefix}_min": 0.0, f"{prefix}_max": 0.0}
    return {f"{prefix}_mean": float(values.mean()), f"{prefix}_min": float(values.min()),
            f"{prefix}_max": float(values.max())}


def _fraction(mask: torch.Tensor, within: torch.Tensor) -> float:
    count = int(within.sum())
    return float((mask & within).sum()) / count if count else 0.0


def _cross_zero_grad(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float, mode: str) -> torch.Tensor:
    """[S] bool: cross sequences whose clip leaves no gradient (§5 clamp: outside [low, high];
    §5a pessimistic, §5c gspo and §5d decoupled (on r): only the side where the bound is the minimum)."""
    if mode in BOUNDED_MODES:
        return ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
    return (ratio < low) | (ratio > high)


def cross_clipped_at_start(log_ratio: float, advantage: float, center: float, cfg: HACPOConfig) -> bool:
    """Whether the cross window of the step's first update (m = 0) leaves one cross sample without gradient,
    as ``cross_clipfrac`` counts it: s·e^(−c) (log s = ``log_ratio``, c = ``center`` of §5b) outside
    [lb_0, 1] (eq. 14), or for §5a / §5c only beyond the bound on the advantage's side. §5d clips
    r = π_θ/π^(k)_old, which is 1 at m = 0; without ``cross_clip`` nothing is clipped."""
    if not cfg.cross_clip or cfg.cross_clip_mode == "decoupled":
        return False
    low, high = cross_window(0, cfg)
    shifted = torch.tensor([math.exp(log_ratio - center)], dtype=torch.float64)
    adv = torch.tensor([advantage], dtype=torch.float64)
    return bool(_cross_zero_grad(shifted, adv, low, high, cfg.cross_clip_mode)[0])


def _pair_metrics(log_ratio: torch.Tensor, zero_grad: torch.Tensor, adv: torch.Tensor, own: torch.Tensor,
                  source_index: torch.Tensor, center: torch.Tensor | None) -> dict[str, float]:
    """Per learner-source pair j (cross sequences of source j in this micro-batch; absent sources
    give no keys): ``cross_clipfrac/<j>/pos`` and ``/neg`` (share with no gradient among A > 0 /
    A < 0; 0 when that sign is absent), ``cross_center/<j>`` (c of §5b) and
    ``cross_log_ratio_median/<j>`` (median of the raw log s, the adaptive window's statistic)."""
    out: dict[str, float] = {}
    for j in sorted(set(source_index[~own].tolist())):
        pair = (source_index == j) & ~own
        out[f"cross_clipfrac/{j}/pos"] = _fraction(zero_grad, pair & (adv > 0))
        out[f"cross_clipfrac/{j}/neg"] = _fraction(zero_grad, pair & (adv < 0))
        out[f"cross_center/{j}"] = float(center[pair][0]) if center is not None else 0.0
        out[f"cross_log_ratio_median/{j}"] = float(log_ratio[pair].quantile(0.5))
    return out


def hacpo_metrics(log_ratio: torch.Tensor, advantages: torch.Tensor, is_self: torch.Tensor,
                  update_index: int, cfg: HACPOConfig, source_index: torch.Tensor | None = None,
                  center: torch.Tensor | None = None, old_log_ratio: torch.Tensor | None = None,
                  family_index: torch.Tensor | None = None) -> dict[str, float]:
    """Ratio statistics and clip fractions of one (micro-)batch; empty groups report 0.

    Ratio statistics and counts are split by source (self vs cross); ratios are the raw s. self_clipfrac:
    share of the sequences under GSPO's clip (self ones; all for naive/gspo) whose clipped branch is
    active (zero gradient). cross_clipfrac: share of sequences under the cross window with A ≠ 0 that
    the window leaves without gradient (§5 or §5a, on s·e^(−c) with the centre c of §5b; §5d on the
    proximal ratio r = s·e^(−old_log_ratio), and then also ``cross_behaviour_weight_mean``, the mean
    of w = min(1, e^old_log_ratio) over cross sequences).
    With ``source_index`` ([S] int64) also the per-pair metrics of :func:`_pair_metrics`, and with
    ``family_index`` ([S] int64, −1: no family) as well the per-family ones of :func:`_family_metrics`.
    """
    with torch.no_grad():
        log_ratio = log_ratio.detach().double()
        ratio = torch.exp(log_ratio)
        decoupled = cfg.cross_clip_mode == "decoupled" and old_log_ratio is not None
        if decoupled:  # §5d clips the proximal ratio r
            shifted = torch.exp(log_ratio - old_log_ratio.detach().double())
        else:
            shifted = ratio if center is None else torch.exp(log_ratio - center.double())
        adv = advantages.detach().double()
        own = is_self.bool()
        gspo_clipped = torch.ones_like(own) if cfg.algorithm in ("naive", "gspo", "gspo_x2") else own
        low, high = cross_window(update_index, cfg)
        if not cfg.cross_clip:
            low, high = float("-inf"), float("inf")
        self_clipped = ((adv > 0) & (ratio > 1 + cfg.self_clip_high)) | ((adv < 0) & (ratio < 1 - cfg.self_clip_low))
        cross_clipped = _cross_zero_grad(shifted, adv, low, high, cfg.cross_clip_mode)
        metrics = {
            **_stats(ratio[own], "self_ratio"),
            **_stats(ratio[~own], "cross_ratio"),
            "self_clipfrac": _fraction(self_clipped, gspo_clipped),
            "cross_clipfrac": _fraction(cross_clipped, ~gspo_clipped & (adv != 0)),
            "cross_lower_bound": low if cfg.cross_clip else 0.0,
            "adv_abs_mean": float(adv.abs().mean()) if adv.numel() else 0.0,
            "num_self": float(own.sum()),
            "num_cross": float((~own).sum()),
        }
        if decoupled:
            weight = torch.exp(old_log_ratio.detach().double()[~own]).clamp(max=1.0)
            metrics["cross_behaviour_weight_mean"] = float(weight.mean()) if weight.numel() else 0.0
        if source_index is not None:
            zero_grad = torch.where(gspo_clipped, self_clipped, cross_clipped)
            metrics.update(_pair_metrics(log_ratio, zero_grad, adv, own, source_index, center))
            if family_index is not None:
                side = torch.where(shifted > high, 1, torch.where(shifted < low, -1, 0))
                metrics.update(_family_metrics(log_ratio, zero_grad, side, adv, gspo_clipped, source_index,
                                               family_index.to(own.device)))
    return metrics


def _family_metrics(log_ratio: torch.Tensor, zero_grad: torch.Tensor, side: torch.Tensor, adv: torch.Tensor,
                    gspo_clipped: torch.Tensor, source_index: torch.Tensor,
                    family_index: torch.Tensor) -> dict[str, float]:
    """Per problem family f present in this micro-batch (``family_index`` ≥ 0), keys ``family/<f>/...``:
    ``self_clipfrac`` (f's sequences under GSPO's clip whose clipped branch is active) and, per source j
    with cross sequences of f, for each sign of A present: ``cross_clipfrac/<j>/<pos|neg>`` (the share the
    cross window leaves without gradient) split by the side of the window the clipped ratio lies on,
    ``/above`` (s̃ > the upper end) and ``/below`` (s̃ < lb_m), which sum to it; and
    ``cross_log_ratio_median/<j>`` (the median raw log s). ``side`` [S]: +1 above, −1 below, 0 inside.
    Keys of an absent family, source or sign are left out (not reported as 0), so means over micro-batches
    and updates count only those that had such sequences."""
    out: dict[str, float] = {}
    for f in _families_present(family_index):
        family = family_index == f
        if (family & gspo_clipped).any():
            out[f"family/{f}/self_clipfrac"] = _fraction(zero_grad, family & gspo_clipped)
        cross = family & ~gspo_clipped
        for j in sorted(set(source_index[cross].tolist())):
            pair = cross & (source_index == j)
            for sign, rows in (("pos", pair & (adv > 0)), ("neg", pair & (adv < 0))):
                if rows.any():
                    key = f"family/{f}/cross_clipfrac/{j}/{sign}"
                    out[key] = _fraction(zero_grad, rows)
                    out[f"{key}/above"] = _fraction(zero_grad & (side > 0), rows)
                    out[f"{key}/below"] = _fraction(zero_grad & (side < 0), rows)
            out[f"family/{f}/cross_log_ratio_median/{j}"] = float(log_ratio[pair].quantile(0.5))
    return out


def _families_present(family_index: torch.Tensor) -> list[int]:
    """The family indices (≥ 0; −1 is no family) that occur in ``family_index`` [S], ascending."""
    return sorted(set(family_index[family_index >= 0].tolist()))


def hacpo_loss(
    learner_logp_sum: torch.Tensor,
    learner_len: torch.Tensor,
    inputs: LossInputs,
    update_index: int,
    cfg: HACPOConfig,
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss = −Σ J / num_sequences (docs/algorithm.md §7) and metrics, from the learner's log-probs.

    Args:
        learner_logp_sum: [S] Σ log π^(k)_θ over each response in the learner's tokens (differentiable).
        learner_len: [S] L_k, the learner's response token counts.
        inputs: the sequences' :class:`LossInputs` (advantages, is_self, discrepancy, source statistics).
        update_index: m, optimizer updates already made by this learner in this step (eq. 14).
        cfg: algorithm switches; ``cfg.max_abs_log_ratio`` clamps log s (eq. 11).
        num_sequences: the **global** number of sequences in the mini-batch (across micro-batches and
            data-parallel ranks); defaults to this call's S.

    Returns a scalar differentiable through ``learner_logp_sum`` (an exact 0 with a graph when S = 0).
    """
    if len(inputs) != learner_logp_sum.numel():
        raise ValueError(f"hacpo_loss: inputs hold {len(inputs)} sequences, learner_logp_sum "
                         f"{learner_logp_sum.numel()}")
    log_ratio = sequence_log_ratio(learner_logp_sum, learner_len, inputs.source_logp_sum, inputs.source_len,
                                   cfg.max_abs_log_ratio)
    old_log_ratio = _old_log_ratio(learner_len, inputs, cfg)
    objective = hacpo_sequence_objective(log_ratio, inputs.advantages, inputs.is_self, inputs.discrepancy,
                                         update_index, cfg, center=inputs.cross_center, old_log_ratio=old_log_ratio)
    denom = log_ratio.numel() if num_sequences is None else num_sequences
    if denom <= 0:
        if log_ratio.numel():
            raise ValueError(f"num_sequences={num_sequences} must be > 0 for a non-empty batch")
        denom = 1
    weight_metrics: dict[str, float] = {}
    if inputs.behaviour_log_ratio is not None:  # stale self samples (docs/algorithm.md §7b)
        objective, weight_metrics = _behaviour_weighted(objective, inputs.behaviour_log_ratio, inputs.is_self)
    loss = -objective.sum() / denom
    metrics = hacpo_metrics(log_ratio, inputs.advantages, inputs.is_self, update_index, cfg,
                            source_index=inputs.source_index, center=inputs.cross_center, old_log_ratio=old_log_ratio,
                            family_index=inputs.family_index)
    metrics.update(weight_metrics)
    metrics["objective_mean"] = float(objective.detach().mean()) if objective.numel() else 0.0
    if cfg.log_cross_grad_share:
        metrics.update(cross_grad_shares(objective, log_ratio, inputs.is_self, inputs.family_index))
    return loss, metrics


def cross_grad_shares(objective: torch.Tensor, log_ratio: torch.Tensor, is_self: torch.Tensor,
                      family_index: torch.Tensor | None = None) -> dict[str, float]:
    """``cross_grad_share`` of :func:`cross_grad_share` and, with ``family_index`` ([S] int64, −1: no family),
    ``family/<f>/cross_grad_share`` = ‖g_cross,f‖ / ‖g_f‖ over the rows of family f present in the micro-batch
    (the share of f's part of the update that cross samples carry; 0 when g_f = 0). Empty without a graph."""
    grad = _sequence_grad(objective, log_ratio)
    if grad is None:
        return {}
    cross = ~is_self.bool().to(grad.device)
    out = {"cross_grad_share": _norm_share(grad, cross, torch.ones_like(cross))}
    if family_index is not None:
        family_index = family_index.to(grad.device)
        for f in _families_present(family_index):
            out[f"family/{f}/cross_grad_share"] = _norm_share(grad, cross, family_index == f)
    return out


def _norm_share(grad: torch.Tensor, part: torch.Tensor, within: torch.Tensor) -> float:
    total = float(grad[within].norm())
    return float(grad[part & within].norm()) / total if total > 0 else 0.0


def _sequence_grad(objective: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor | None:
    """g = ∂(Σ J)/∂ℓ [S] float64 (ℓ: each sequence's per-token mean log-likelihood); None without a graph."""
    if not (objective.requires_grad and log_ratio.requires_grad) or objective.numel() == 0:
        return None
    (grad,) = torch.autograd.grad(objective.sum(), log_ratio, retain_graph=True, allow_unused=True)
    return None if grad is None else grad.detach().double()


def cross_grad_share(objective: torch.Tensor, log_ratio: torch.Tensor, is_self: torch.Tensor) -> float | None:
    """‖g_cross‖ / ‖g‖ with g = ∂(Σ J)/∂ℓ [S] the gradient of the micro-batch's objective with respect to
    each sequence's per-token mean log-likelihood ℓ_i = (1/L_k)·Σ_t log π^(k)_θ (eq. 11: log s = ℓ − const),
    and g_cross its cross rows (self rows set to 0); 0 when g = 0; None without a graph (no gradient to split).

    The parameters' gradient is Σ_i g_i ∇ℓ_i, so g says how much of the step each sequence carries: a cross
    sample outside the window has g_i = 0, one inside carries ω·s_c^(α+1)·A (§5). The norm is taken in
    this space of sequences, not of parameters (that would need a second backward through the model);
    docs/algorithm.md §10b states what it measures."""
    return cross_grad_shares(objective, log_ratio, is_self).get("cross_grad_share")


def _behaviour_weighted(objective: torch.Tensor, behaviour_log_ratio: torch.Tensor,
                        is_self: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """J · w with the truncated behaviour weight w = min(1, e^b), b = (1/L)·(Σ log π_prox − Σ log π_behav)
    per self sequence (0 on cross rows: w = 1), a constant (docs/algorithm.md §7b); and its metrics
    over self sequences: ``behaviour_weight_mean`` and ``behaviour_truncfrac`` (share with b > 0)."""
    b = behaviour_log_ratio.detach().to(device=objective.device, dtype=objective.dtype)
    weight = torch.exp(b).clamp(max=1.0)
    own = is_self.bool().to(objective.device)
    with torch.no_grad():
        count = int(own.sum())
        metrics = {"behaviour_weight_mean": float(weight[own].mean()) if count else 1.0,
                   "behaviour_truncfrac": float((b[own] > 0).sum()) / count if count else 0.0}
    return objective * weight, metrics


def _old_log_ratio(learner_len: torch.Tensor, inputs: LossInputs, cfg: HACPOConfig) -> torch.Tensor | None:
    """log s at the learner's old policy (eq. 11 with π^(k)_old), [S], for ``cross_clip_mode=decoupled``
    (docs/algorithm.md §5d); None for every other mode or algorithm."""
    if cfg.cross_clip_mode != "decoupled" or cfg.algorithm != "hacpo":
        return None
    if inputs.learner_old_logp_sum is None:
        raise ValueError("hacpo.cross_clip_mode=decoupled needs LossInputs.learner_old_logp_sum (the learner's "
                         "Σ log π_old over every sequence, filled by the trainer's old log-prob stage); got None")
    return sequence_log_ratio(inputs.learner_old_logp_sum.to(learner_len.device), learner_len,
                              inputs.source_logp_sum, inputs.source_len, cfg.max_abs_log_ratio)
