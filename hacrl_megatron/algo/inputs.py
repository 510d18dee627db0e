"""The per-sequence inputs of a learner's loss, as one record (paper eq. 7, 10-11; GRPO's π_old).

Built once per step by the trainer for learner k's step batch, sliced with the sequences into
mini- and micro-batches, and read by :func:`~hacrl_megatron.algo.hacpo_loss`,
:func:`~hacrl_megatron.kernels.fused_hacpo_loss`, GRPO's token loss and the peer-sharing losses of
:mod:`~hacrl_megatron.algo.peer_sharing` (docs/algorithm.md §8a: SGT's rescue set is carried in the
advantages, and its untransferred peer responses never enter the batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class LossInputs:
    """What the loss needs to know about each of S sequences besides the learner's own log-probs.

    advantages: [S] float, A^(k) of each sequence (eq. 7), constants.
    is_self: [S] bool, True where the source agent j is the learner k.
    discrepancy: [S] float, ω^(j,k) = clip(P̂_j / P̂_k) of each sequence's source (eq. 10; 1 for self).
    source_logp_sum: [S] float, Σ log π^(j)_old over the response in the source's tokens (eq. 11).
    source_len: [S] int64, L_j, the source's response token count (eq. 11).
    old_token_logp: [S, T] float or None, the token-level methods only (GRPO, §8a's): the learner's own
        per-token log π_old of each self response, right-padded to the longest response T (sequence s uses
        its first ``seq_len[s]`` entries); cross rows are zeros, never read (a re-tokenized response has no
        per-token π_old in the learner's tokens, docs/algorithm.md §8a).
    source_index: [S] int64 or None, the source agent j of each sequence (config order); enables the
        per-pair metrics (``cross_clipfrac/<j>/pos`` ...). None: no per-pair metrics.
    cross_center: [S] float or None, the adaptive window's log-space centre c^(k,j) of each
        sequence's pair (docs/algorithm.md §5b; 0 for self sequences). None: every c = 0 (fixed window).
    learner_old_logp_sum: [S] float or None, Σ log π^(k)_old over the response in the **learner's**
        tokens, before any update of the step (equals source_logp_sum for self sequences). Needed by
        ``hacpo.cross_clip_mode=decoupled`` and ``naive_merge`` (docs/algorithm.md §5d, §8).
    ref_token_logp: [S, T] float or None, the frozen reference policy's per-token log-probs of each
        self response, right-padded like ``old_token_logp`` (cross rows are zeros, never read). Needed by
        the KL penalty (``hacpo.kl_coef > 0``, docs/algorithm.md §7).
    behaviour_log_ratio: [S] float or None, b = (1/L)·(Σ log π_prox − Σ log π_behav) of each self sequence
        sampled by older weights than the learner's at the start of its update (0 on cross rows and fresh
        ones); the objective is weighted by min(1, e^b) (docs/algorithm.md §7b). None: every sample is
        fresh (train.rollout_mode=sync), no weight.
    family_index: [S] int64 or None, the problem family of each sequence's prompt (an index into the task's
        ``families``, e.g. ``add_sub_cot``'s ``("add", "sub")``; −1: a prompt of no family); enables the
        per-family metrics (``family/<f>/cross_clipfrac/<j>/pos`` ..., docs/algorithm.md §10b). None: none.
    """

    advantages: torch.Tensor
    is_self: torch.Tensor
    discrepancy: torch.Tensor
    source_logp_sum: torch.Tensor
    source_len: torch.Tensor
    old_token_logp: torch.Tensor | None = None
    source_index: torch.Tensor | None = None
    cross_center: torch.Tensor | None = None
    learner_old_logp_sum: torch.Tensor | None = None
    ref_token_logp: torch.Tensor | None = None
    behaviour_log_ratio: torch.Tensor | None = None
    family_index: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.advantages.dim() != 1:
            raise ValueError(f"LossInputs.advantages must be [S], got shape {tuple(self.advantages.shape)}")
        s = self.advantages.shape[0]
        for name in ("is_self", "discrepancy", "source_logp_sum", "source_len"):
            value = getattr(self, name)
            if value.shape != (s,):
                raise ValueError(f"LossInputs.{name} has shape {tuple(value.shape)}, expected ({s},) like advantages")
        if self.is_self.dtype != torch.bool:
            raise ValueError(f"LossInputs.is_self must be a bool tensor, got {self.is_self.dtype}")
        for name in ("source_index", "cross_center", "learner_old_logp_sum", "behaviour_log_ratio", "family_index"):
            value = getattr(self, name)
            if value is not None and value.shape != (s,):
                raise ValueError(f"LossInputs.{name} has shape {tuple(value.shape)}, expected ({s},) like advantages")
        for name in ("old_token_logp", "ref_token_logp"):
            value = getattr(self, name)
            if value is not None and (value.dim() != 2 or value.shape[0] != s):
                raise ValueError(f"LossInputs.{name} has shape {tuple(value.shape)}, expected ({s}, T)")

    def __len__(self) -> int:
        return self.advantages.shape[0]

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> LossInputs:
        return LossInputs(**{f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                             for f in fields(self)})

    def select(self, index: torch.Tensor) -> LossInputs:
        """The rows ``index`` (int64 [S'], in the given order) of every field."""
        return self._map(lambda t: t[index])

    def to(self, device: torch.device | str) -> LossInputs:
        """Every field on ``device``."""
        return self._map(lambda t: t.to(device))
