"""GRPO's token-level clipped objective, the GRPO baseline of docs/algorithm.md §8.

J_t = min(r_t·A, clip(r_t, 1 − ε_low, 1 + ε_high)·A),  r_t = π_θ(y_t)/π_old(y_t),
with ε_low = 0.2, ε_high = 0.28 (clip-higher) and token-mean aggregation over the global number
of tokens of the mini-batch.
"""

from __future__ import annotations

import torch


def broadcast_to_tokens(per_sequence: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Repeat a [S] per-sequence value over each sequence's tokens: [N] with N = cu_seqlens[-1]."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if lengths.numel() != per_sequence.numel():
        raise ValueError(f"{per_sequence.numel()} values for {lengths.numel()} sequences in cu_seqlens")
    return torch.repeat_interleave(per_sequence, lengths)


def grpo_token_loss(
    token_logp: torch.Tensor,
    old_token_logp: torch.Tensor,
    token_advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """−Σ_t J_t / num_tokens and metrics.

    Args:
        token_logp: [N] log π_θ of the sampled tokens (differentiable).
        old_token_logp: [N] log π_old of the same tokens (constants).
        token_advantages: [N] the sequence advantage broadcast to its tokens.
        num_tokens: global token count of the mini-batch (defaults to N) so that micro-batch
            losses add up to the mini-batch loss.
    """
    if not token_logp.shape == old_token_logp.shape == token_advantages.shape or token_logp.dim() != 1:
        raise ValueError(
            f"grpo_token_loss expects three [N] tensors, got {tuple(token_logp.shape)}, "
            f"{tuple(old_token_logp.shape)}, {tuple(token_advantages.shape)}"
        )
    log_ratio = (token_logp - old_token_logp.to(token_logp.dtype)).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    adv = token_advantages.to(ratio.dtype)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    objective = torch.minimum(unclipped, clipped)
    denom = token_logp.numel() if num_tokens is None else num_tokens
    loss = -objective.sum() / max(denom, 1)
    with torch.no_grad():
        n = ratio.numel()
        metrics = {
            "token_ratio_mean": float(ratio.mean()) if n else 0.0,
            "token_clipfrac": float((clipped < unclipped).float().mean()) if n else 0.0,
            "adv_abs_mean": float(adv.abs().mean()) if n else 0.0,
        }
    return loss, metrics
