"""The training method of a run as one object (docs/algorithm.md §8; docs/architecture.md, "How to add
an algorithm variant").

:func:`build_algorithm` turns ``hacpo.*`` into an :class:`Algorithm` once per run. The trainer asks it
what a step needs and never compares method names itself:

* :attr:`Algorithm.passes`: the forward passes a step needs besides each source's Σ log π_old
  (per-token old log-probs, the learner's π_old on the other agents' responses, ...);
* :meth:`Algorithm.samples_per_prompt`: G, or 2G for the resource-equivalent GSPO×2;
* :meth:`Algorithm.sources`: whose responses learner k trains on (all agents, or its own only);
* :meth:`Algorithm.advantages`: A^(k) of those responses (eq. 6-7);
* :meth:`Algorithm.trains_on`: which of those responses enter the learner's batch (all, or e.g. SGT's
  transferred peer successes only, §8a);
* :attr:`Algorithm.needs_peers` / :attr:`Algorithm.alone_method`: whether a step needs every agent's
  responses or rewards, and the method a job falls back to when a peer's are missing (trainer/peers.py);
* :meth:`Algorithm.cross_centers` / :meth:`Algorithm.record_cross_statistics`: the adaptive
  window's per-pair state (§5b);
* :meth:`Algorithm.loss_fn`: the learner's loss on a micro-batch.

A new variant is a subclass here (or a new switch of an existing one) plus its config fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from hacrl_megatron.algo.advantages import capability_aware_advantages
from hacrl_megatron.algo.capability import CapabilityTracker
from hacrl_megatron.algo.grpo import broadcast_to_tokens, grpo_token_loss
from hacrl_megatron.algo.hacpo import adaptive_center, cross_clipped_at_start, hacpo_loss
from hacrl_megatron.algo.inputs import LossInputs
from hacrl_megatron.algo.kl import self_kl_penalty
from hacrl_megatron.algo.peer_sharing import (
    old_log_ratio,
    peer_token_loss,
    peer_weights,
    pooled_advantages,
    pooled_own_advantages,
    sgt_advantages,
    sgt_transfer_mask,
)
from hacrl_megatron.config import HACPOConfig

PAIR_METRICS = ("cross_clipfrac", "cross_center", "cross_log_ratio_median")  # keyed by source index in hacpo.py


class LogProbs(Protocol):
    """The learner's log-probs of one micro-batch (``agents.batch.LogProbOutput``)."""

    token_logps: torch.Tensor  # [N] response-token log π_θ, sequences concatenated
    cu_seqlens: torch.Tensor  # [S + 1] int64 offsets of each sequence in token_logps
    seq_logp_sum: torch.Tensor  # [S] Σ log π_θ per response
    seq_len: torch.Tensor  # [S] int64 response tokens per sequence


class UpdateInfo(Protocol):
    """The mini-batch a micro-batch belongs to (``agents.batch.MiniBatchInfo``)."""

    update_index: int  # m: optimizer updates this learner already made this step
    num_sequences: int  # global sequences of the mini-batch
    num_tokens: int  # global response tokens of the mini-batch


LossFn = Callable[[LogProbs, LossInputs | None, UpdateInfo], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class StepPasses:
    """Forward passes a step needs besides every source's Σ log π^(j)_old on its own responses.

    source_token_logps: each source's per-token log π^(j)_old on its own responses (token-level
        objectives: GRPO), carried to the loss as ``LossInputs.old_token_logp``.
    learner_old_on_others: each learner's Σ log π^(k)_old over every other agent's responses in its
        own tokens, before any update (one more pass per learner), carried as
        ``LossInputs.learner_old_logp_sum`` (§5d, and Naive's plain-merge reading, §8).
    reference_on_self: the frozen starting policy's per-token log-probs of each learner's own
        responses (the KL penalty, §7), carried as ``LossInputs.ref_token_logp``.
    """

    source_token_logps: bool = False
    learner_old_on_others: bool = False
    reference_on_self: bool = False


def _required(inputs: LossInputs | None) -> LossInputs:
    if inputs is None:
        raise ValueError("the RL loss needs the batch's loss_inputs (built by learner_batch); got None")
    return inputs


def name_pair_metrics(metrics: dict[str, float], names: list[str], families: tuple[str, ...] = ()) -> dict[str, float]:
    """``cross_clipfrac/<j>/pos`` → ``cross_clipfrac/<name of agent j>/pos`` (and the other per-pair keys);
    ``family/<f>/<key>`` → ``family/<name of family f>/<key named the same way>`` (``families``: the task's)."""
    out = {}
    for key, value in metrics.items():
        prefix = ""
        if key.startswith("family/"):
            _, index, key = key.split("/", 2)
            if int(index) >= len(families):
                raise ValueError(f"metric family/{index}/{key}: family index {index} of a task with families "
                                 f"{list(families)} (pass the task's families to Algorithm.loss_fn)")
            prefix = f"family/{families[int(index)]}/"
        head, sep, rest = key.partition("/")
        if sep and head in PAIR_METRICS:
            index, _, tail = rest.partition("/")
            key = "/".join(p for p in (head, names[int(index)], tail) if p)
        out[prefix + key] = value
    return out


class Algorithm:
    """A sequence-level method: HACPO and its ablations and cross-term variants, GSPO, GSPO×2, Naive (the
    token-level ones, GRPO and §8a's, are subclasses below).

    Args:
        cfg: the run's ``hacpo`` section (validated).
        num_agents: n, the agents in config order.
    """

    method_passes = StepPasses()  # the passes of the method itself; :attr:`passes` adds the KL's
    shares_rollouts = True  # learn from every agent's responses (False: from its own only)
    rollout_multiplier = 1  # samples per prompt = multiplier × rollout.samples_per_prompt
    capability_aware = True  # eq. 6's ω-weighted baseline (False: a plain mean over the pool)
    has_cross_window = True  # cross samples under HACPO's window, so the adaptive centre applies (§5b)
    uses_peer_rewards = False  # the advantages read the other agents' rewards even where sources() is k alone
    alone_method = "gspo"  # a job's step with a peer left out trains this instead (trainer/peers.py)

    def __init__(self, cfg: HACPOConfig, num_agents: int) -> None:
        self.cfg = cfg
        self.num_agents = num_agents
        self.passes = dataclasses.replace(self._passes_of_method(), reference_on_self=cfg.kl_coef > 0)

    def _passes_of_method(self) -> StepPasses:
        return self.method_passes

    @property
    def name(self) -> str:
        return self.cfg.algorithm

    def samples_per_prompt(self, g: int) -> int:
        """Responses each agent samples per prompt, given ``rollout.samples_per_prompt`` = G."""
        return self.rollout_multiplier * g

    def sources(self, learner: int) -> list[int]:
        """Agent indices (config order) whose responses learner ``learner`` trains on."""
        return list(range(self.num_agents)) if self.shares_rollouts else [learner]

    def advantages(self, rewards: torch.Tensor, learner: int, omega: torch.Tensor) -> torch.Tensor:
        """A^(k) [P, len(sources), G] (in the dtype of ``rewards``) of the learner's sources' responses (eq. 6-7).

        ``rewards``: [P, n, G] of all agents; ``omega``: [n, n] ω from the capability tracker (eq. 9).
        """
        h = self.cfg
        if self.shares_rollouts:
            rewards, position, omega_used = rewards, learner, omega
        else:
            rewards, position = rewards[:, learner: learner + 1], 0
            omega_used = torch.ones(1, 1, dtype=torch.float64)
        return capability_aware_advantages(
            rewards, position, omega_used, capability_aware=self.capability_aware and h.capability_aware_advantage,
            uniform_guard=h.uniform_guard, baseline_guard=h.baseline_guard, max_reward=h.max_reward)

    def trains_on(self, rewards: torch.Tensor, learner: int) -> torch.Tensor | None:
        """[P, len(sources), G] bool: which of the sources' responses enter learner ``learner``'s step batch (the
        others are left out, as if never sampled, and count in no normaliser); None: all of them."""
        return None

    @property
    def needs_peers(self) -> bool:
        """Whether a step needs every agent's responses or rewards: a job whose peer is left out of a step
        then trains :attr:`alone_method` on its own responses (trainer/peers.py)."""
        return self.shares_rollouts or self.uses_peer_rewards

    @property
    def uses_adaptive_window(self) -> bool:
        return self.has_cross_window and self.cfg.cross_window != "fixed"

    def cross_centers(self, tracker: CapabilityTracker) -> torch.Tensor | None:
        """c[k, j] [n, n] float64, the adaptive window's centre of every learner-source pair from the
        tracker's running medians (§5b); None for the fixed window or a method without a cross window."""
        if not self.uses_adaptive_window:
            return None
        n = self.num_agents
        return torch.tensor([[0.0 if k == j else adaptive_center(tracker.median_log_ratio(k, j), self.cfg)
                              for j in range(n)] for k in range(n)], dtype=torch.float64)

    def cross_clipped(self, log_ratio: float, advantage: float, center: float = 0.0) -> bool | None:
        """Whether the first update's cross window leaves a cross sample (log s, its advantage, the pair's
        adaptive centre) without gradient (:func:`~hacrl_megatron.algo.hacpo.cross_clipped_at_start`);
        None for a method without a cross window."""
        return cross_clipped_at_start(log_ratio, advantage, center, self.cfg) if self.has_cross_window else None

    def record_cross_statistics(self, tracker: CapabilityTracker, metrics: dict[str, float], names: list[str]) -> None:
        """Feed this step's per-pair median log s (``<k>/hacpo/cross_log_ratio_median/<j>``, the mean over
        the step's micro-batches) into the tracker's running window; pairs without cross samples are skipped."""
        if not self.uses_adaptive_window:
            return
        for k, learner in enumerate(names):
            for j, source in enumerate(names):
                value = metrics.get(f"{learner}/hacpo/cross_log_ratio_median/{source}")
                if k != j and value is not None:
                    tracker.record_log_ratio(k, j, value)

    def loss_fn(self, names: list[str], families: tuple[str, ...] = ()) -> LossFn:
        """The learner's loss on a micro-batch and its metrics: the method's policy loss (:meth:`policy_loss_fn`)
        plus, with ``hacpo.kl_coef > 0``, the KL penalty on self responses (§7, metrics ``kl`` and ``kl_penalty``).
        ``families``: the task's problem families, which name the per-family metrics (LossInputs.family_index)."""
        policy = self.policy_loss_fn(names, families)
        if not self.passes.reference_on_self:
            return policy
        coef, estimator = self.cfg.kl_coef, self.cfg.kl_estimator

        def with_kl(out: LogProbs, inputs: LossInputs | None, info: UpdateInfo) -> tuple[torch.Tensor, dict[str, float]]:
            loss, metrics = policy(out, inputs, info)
            inputs = _required(inputs)
            if inputs.ref_token_logp is None:
                raise ValueError("hacpo.kl_coef > 0 needs LossInputs.ref_token_logp (the reference policy's per-token "
                                 "log-probs of the self responses, filled by the trainer's old log-prob stage)")
            penalty, per_seq = self_kl_penalty(out.token_logps, out.cu_seqlens, inputs.ref_token_logp.to(
                out.token_logps.device), inputs.is_self.to(out.token_logps.device), estimator, info.num_sequences)
            kl = {"kl": float(per_seq.mean()) if per_seq.numel() else 0.0, "kl_penalty": coef * float(penalty.detach())}
            return loss + coef * penalty, {**metrics, **kl}

        return with_kl

    def policy_loss_fn(self, names: list[str], families: tuple[str, ...] = ()) -> LossFn:
        """The method's own loss on a micro-batch: −Σ J / global #sequences and its metrics (§7), per-pair
        metric keys named after the agents ``names`` (config order), per-family ones after ``families``."""
        cfg = self.cfg

        def sequence_loss(out: LogProbs, inputs: LossInputs | None,
                          info: UpdateInfo) -> tuple[torch.Tensor, dict[str, float]]:
            loss, metrics = hacpo_loss(out.seq_logp_sum, out.seq_len, _required(inputs), info.update_index, cfg,
                                       num_sequences=info.num_sequences)
            return loss, name_pair_metrics(metrics, names, families)

        return sequence_loss


class HACPO(Algorithm):
    """HACPO (eq. 6-14) with its ablations and cross-term variants (§5a-5d, §8)."""

    def _passes_of_method(self) -> StepPasses:
        # §5d: the proximal ratio of a cross sample needs the learner's own π_old on it
        return StepPasses(learner_old_on_others=self.cfg.cross_clip_mode == "decoupled")


class Naive(Algorithm):
    """Shared rollouts, a plain mean baseline, GSPO's clip on every sequence with its author's π_old (§8)."""

    capability_aware = False
    has_cross_window = False


class NaiveMerge(Naive):
    """Naive as a stock trainer runs merged rollouts (§8, the plain-merge reading): the learner recomputes
    π_old on every merged sample itself, so each cross sample's ratio is π^(k)_θ/π^(k)_old in the learner's
    tokens (s = 1 at the first update), GSPO's clip on every sequence, no importance correction toward
    the author, ω ≡ 1, α = 0."""

    method_passes = StepPasses(learner_old_on_others=True)

    def policy_loss_fn(self, names: list[str], families: tuple[str, ...] = ()) -> LossFn:
        cfg = dataclasses.replace(self.cfg, algorithm="naive")  # Naive's objective on the learner's own ratios

        def merged_loss(out: LogProbs, inputs: LossInputs | None,
                        info: UpdateInfo) -> tuple[torch.Tensor, dict[str, float]]:
            inputs = _required(inputs)
            if inputs.learner_old_logp_sum is None:
                raise ValueError("hacpo.algorithm=naive_merge needs LossInputs.learner_old_logp_sum (the learner's "
                                 "Σ log π_old over every merged response, filled by the trainer's old log-prob stage)")
            # self rows: learner_old_logp_sum is the learner's own Σ log π_old already; lengths are the learner's
            own_view = dataclasses.replace(inputs, source_logp_sum=inputs.learner_old_logp_sum,
                                           source_len=out.seq_len.to(inputs.source_len.device))
            loss, metrics = hacpo_loss(out.seq_logp_sum, out.seq_len, own_view, info.update_index, cfg,
                                       num_sequences=info.num_sequences)
            return loss, name_pair_metrics(metrics, names, families)

        return merged_loss


class GSPO(Algorithm):
    """Each agent alone on its own G responses (GSPO)."""

    shares_rollouts = False
    has_cross_window = False


class GSPOx2(GSPO):
    """GSPO with 2G responses per prompt: the resource-equivalent baseline (§8)."""

    rollout_multiplier = 2


class GRPO(Algorithm):
    """Each agent alone with GRPO's token-level clipped objective (§8); needs per-token log π_old."""

    shares_rollouts = False
    has_cross_window = False
    method_passes = StepPasses(source_token_logps=True)

    def policy_loss_fn(self, names: list[str], families: tuple[str, ...] = ()) -> LossFn:
        cfg = self.cfg

        def grpo_loss(out: LogProbs, inputs: LossInputs | None,
                      info: UpdateInfo) -> tuple[torch.Tensor, dict[str, float]]:
            inputs = _required(inputs)
            if inputs.old_token_logp is None:
                raise ValueError("GRPO's loss needs LossInputs.old_token_logp (the per-token log π_old)")
            old = torch.cat([inputs.old_token_logp[i, :n] for i, n in enumerate(out.seq_len.tolist())])
            token_adv = broadcast_to_tokens(inputs.advantages, out.cu_seqlens)
            return grpo_token_loss(out.token_logps, old, token_adv, clip_low=cfg.grpo_clip_low,
                                   clip_high=cfg.grpo_clip_high, num_tokens=info.num_tokens)

        return grpo_loss


class MutualXGRPO(GRPO):
    """Mutual RL's Cross-Policy GRPO Advantage Sharing (§8a): GRPO on the learner's own responses, its group
    baseline and scale taken over every agent's n·G rewards of the prompt."""

    uses_peer_rewards = True
    alone_method = "grpo"

    def advantages(self, rewards: torch.Tensor, learner: int, omega: torch.Tensor) -> torch.Tensor:
        return pooled_own_advantages(rewards, learner, self.cfg)


class _PeerTokenLevel(Algorithm):
    """GRPO on the learner's own responses plus a sequence-level term per peer response in the learner's
    tokens, weighted by :func:`~hacrl_megatron.algo.peer_sharing.peer_weights` (§8a): PRP, SGT and F-TIS."""

    capability_aware = False
    has_cross_window = False
    alone_method = "grpo"
    # own rows: per-token π_old (GRPO); peer rows: the learner's Σ log π_old over them (ρ and s_old)
    method_passes = StepPasses(source_token_logps=True, learner_old_on_others=True)

    def advantages(self, rewards: torch.Tensor, learner: int, omega: torch.Tensor) -> torch.Tensor:
        return pooled_advantages(rewards, self.cfg)

    def policy_loss_fn(self, names: list[str], families: tuple[str, ...] = ()) -> LossFn:
        cfg = self.cfg

        def peer_loss(out: LogProbs, inputs: LossInputs | None,
                      info: UpdateInfo) -> tuple[torch.Tensor, dict[str, float]]:
            inputs = _required(inputs)
            weight, weight_metrics = peer_weights(cfg.algorithm, old_log_ratio(out, inputs, cfg), inputs.advantages,
                                                  inputs.is_self, cfg)
            loss, metrics = peer_token_loss(out, inputs, weight, cfg, num_tokens=info.num_tokens)
            return loss, {**metrics, **weight_metrics}

        return peer_loss


class MutualPRP(_PeerTokenLevel):
    """Mutual RL's Peer Rollout Pooling (§8a): peers' responses join the group (pooled GRPO advantage), each
    weighted by its density ratio min(s_old, ``hacpo.prp_max_weight``)."""


class MutualSGT(_PeerTokenLevel):
    """Mutual RL's Success-Gated Transfer (§8a): GRPO on the learner's own group; on prompts where none of its own
    responses succeeds, the peers' successes join with advantage ``hacpo.sgt_coef`` and weight 1."""

    def advantages(self, rewards: torch.Tensor, learner: int, omega: torch.Tensor) -> torch.Tensor:
        return sgt_advantages(rewards, learner, self.cfg)

    def trains_on(self, rewards: torch.Tensor, learner: int) -> torch.Tensor:
        # own responses always; of the peers' only the transferred successes (no zero-advantage rows diluting N)
        mask = sgt_transfer_mask(rewards, learner, self.cfg.sgt_success_threshold)
        mask[:, learner] = True
        return mask


class FTIS(_PeerTokenLevel):
    """F-TIS (§8a): peers' responses join the group with the truncated weight min(s_old, ``hacpo.ftis_truncation``);
    those with A < 0 and −log s_old > ``hacpo.ftis_kl_threshold`` are filtered out."""


METHODS: dict[str, type[Algorithm]] = {"hacpo": HACPO, "naive": Naive, "naive_merge": NaiveMerge, "gspo": GSPO,
                                       "gspo_x2": GSPOx2, "grpo": GRPO, "mutual_prp": MutualPRP,
                                       "mutual_xgrpo": MutualXGRPO, "mutual_sgt": MutualSGT, "ftis": FTIS}


def build_algorithm(cfg: HACPOConfig, num_agents: int) -> Algorithm:
    """The :class:`Algorithm` of ``hacpo.algorithm`` for ``num_agents`` agents."""
    try:
        method = METHODS[cfg.algorithm]
    except KeyError:
        raise ValueError(f"hacpo.algorithm={cfg.algorithm!r}: one of {sorted(METHODS)}") from None
    return method(cfg, num_agents)
