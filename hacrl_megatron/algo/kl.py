"""The KL penalty to the frozen starting policy on a learner's own responses (docs/algorithm.md §7).

Per response token t of a self response, with x_t = log π_ref(y_t) − log π_θ(y_t):

* ``k1``:          −x_t                       (= log π_θ − log π_ref; unbiased, high variance)
* ``k2``:          ½·x_t²
* ``low_var_kl``:  e^{x_t} − x_t − 1, clamped to [−10, 10]   (k3: unbiased, ≥ 0, low variance;
  Schulman 2020, "Approximating KL divergence"; the clamp is common practice in open RL trainers)

The penalty of a micro-batch is ``kl_coef · Σ_{self s} mean_t k(s, t) / S`` with S the global number
of sequences of the mini-batch: the same "seq-mean-token-mean" aggregation and normaliser as the
policy loss, so micro-batch sums equal the full mini-batch term; cross responses add nothing.
"""

from __future__ import annotations

import torch

KL_CLAMP = 10.0


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """The estimator's value per token [N], differentiable through ``logp`` ([N] log π_θ); ``ref_logp``
    ([N] log π_ref) is a constant."""
    if logp.shape != ref_logp.shape:
        raise ValueError(f"kl_per_token: logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ")
    x = ref_logp.detach().to(logp.dtype) - logp
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator == "low_var_kl":
        return (torch.exp(x) - x - 1.0).clamp(-KL_CLAMP, KL_CLAMP)
    raise ValueError(f"hacpo.kl_estimator={estimator!r}: one of low_var_kl, k1, k2")


def self_kl_penalty(token_logps: torch.Tensor, cu_seqlens: torch.Tensor, ref_token_logp: torch.Tensor,
                    is_self: torch.Tensor, estimator: str, num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over self sequences of the per-sequence token-mean KL / num_sequences, differentiable; and the
    per-sequence token-mean KL [S] of the self sequences, detached, for metrics).

    token_logps: [N] log π_θ of the micro-batch's response tokens, sequences concatenated at
    ``cu_seqlens`` ([S + 1] int64). ref_token_logp: [S, T] log π_ref, right-padded (sequence s uses its
    first L_s entries; cross rows are ignored). is_self: [S] bool.
    """
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if ref_token_logp.shape[0] != len(lens) or is_self.shape != (len(lens),):
        raise ValueError(f"self_kl_penalty: {len(lens)} sequences, ref_token_logp {tuple(ref_token_logp.shape)}, "
                         f"is_self {tuple(is_self.shape)}")
    per_seq = []
    for s, n in enumerate(lens):
        if bool(is_self[s]) and n > 0:
            tokens = token_logps[int(cu_seqlens[s]): int(cu_seqlens[s]) + n]
            per_seq.append(kl_per_token(tokens, ref_token_logp[s, :n].to(tokens.device), estimator).mean())
    if not per_seq:
        zero = token_logps.sum() * 0.0  # keeps the graph: a micro-batch of cross samples only
        return zero, torch.zeros(0, dtype=torch.float64)
    stacked = torch.stack(per_seq)
    return stacked.sum() / max(num_sequences, 1), stacked.detach().double()
