"""The HACPO algorithm as pure tensor functions (docs/algorithm.md §1-8). No I/O, no collectives.

Public contract::

    Algorithm, build_algorithm   the run's method as one object: the passes a step needs, each
                                 learner's sources, G per prompt, advantages and the loss (§8)
    StepPasses                   which extra forward passes a step needs
    CapabilityTracker            P̂ and ω (eq. 8-9); each pair's running log s median (§5b)
    adaptive_center              c^(k,j), the adaptive cross window's log-space centre (§5b)
    capability_baseline          μ^(k), the capability-aware group baseline (eq. 6)
    capability_aware_advantages  A^(k) for all n·G responses of a prompt (eq. 6-7, 50)
    sequence_log_ratio           log s^(k,j) (eq. 11)
    hacpo_sequence_objective     J per sequence: GSPO self term, clipped cross term (eq. 10-14)
    LossInputs                   per-sequence inputs of a learner's loss (A, is_self, ω, source sums)
    hacpo_loss                   −Σ J / global #sequences from the learner's log-prob sums, plus metrics
    grpo_token_loss              GRPO's token-level clipped objective (§8 baseline)
"""

from hacrl_megatron.algo.advantages import capability_aware_advantages, capability_baseline
from hacrl_megatron.algo.algorithm import Algorithm, StepPasses, build_algorithm, name_pair_metrics
from hacrl_megatron.algo.capability import CapabilityTracker, positive_rate
from hacrl_megatron.algo.grpo import broadcast_to_tokens, grpo_token_loss
from hacrl_megatron.algo.hacpo import (
    adaptive_center,
    cross_window,
    gspo_objective,
    hacpo_loss,
    hacpo_metrics,
    hacpo_sequence_objective,
    sequence_log_ratio,
)
from hacrl_megatron.algo.inputs import LossInputs

__all__ = [
    "Algorithm",
    "CapabilityTracker",
    "LossInputs",
    "StepPasses",
    "adaptive_center",
    "broadcast_to_tokens",
    "build_algorithm",
    "capability_aware_advantages",
    "capability_baseline",
    "cross_window",
    "grpo_token_loss",
    "gspo_objective",
    "hacpo_loss",
    "hacpo_metrics",
    "hacpo_sequence_objective",
    "name_pair_metrics",
    "positive_rate",
    "sequence_log_ratio",
]
