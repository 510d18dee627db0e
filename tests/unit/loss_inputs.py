"""Loss inputs whose sequence log-ratio is a given tensor, for tests of the objective itself."""

from __future__ import annotations

import torch

from hacrl_megatron.algo import LossInputs


def from_log_ratio(log_ratio: torch.Tensor, advantages: torch.Tensor, is_self: torch.Tensor,
                   discrepancy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, LossInputs]:
    """(learner Σ log π, L_k, inputs) with L_k = L_j = 1 and a source Σ log π of 0, so that
    ``sequence_log_ratio`` returns ``log_ratio`` exactly (and passes its gradient through unchanged)."""
    ones = torch.ones(log_ratio.shape, dtype=torch.long)
    zeros = torch.zeros(log_ratio.shape, dtype=log_ratio.dtype)
    return log_ratio, ones, LossInputs(advantages, is_self, discrepancy, zeros, ones)
