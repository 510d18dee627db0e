"""Records that cross the trainer ↔ agent boundary.

A :class:`SequenceBatch` holds whole token sequences (prompt + response, in the learner's own
tokenizer) and per-sequence tensors that the loss needs (advantages, is_self, ...). An agent turns
it into a :class:`LogProbOutput`, the per-token log-probs of the response tokens, and hands that to
a :data:`LossFn` together with the matching slice of the per-sequence tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SequenceBatch:
    """S sequences in one learner's tokenizer.

    input_ids: S tensors of shape [T_s] (int64), prompt tokens followed by response tokens.
    prompt_lens: [S] int64, number of prompt tokens of each sequence (response starts there).
    extras: per-sequence tensors of shape [S] (float or bool) passed to the loss unchanged,
        e.g. ``advantages``, ``is_self``, ``discrepancy``, ``source_logp_sum``, ``source_len``.
    """

    input_ids: tuple[torch.Tensor, ...]
    prompt_lens: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s = len(self.input_ids)
        if self.prompt_lens.shape != (s,):
            raise ValueError(f"prompt_lens has shape {tuple(self.prompt_lens.shape)}, expected ({s},)")
        for i, ids in enumerate(self.input_ids):
            if ids.dim() != 1:
                raise ValueError(f"input_ids[{i}] must be 1-D, got shape {tuple(ids.shape)}")
            p = int(self.prompt_lens[i])
            if not 1 <= p < ids.numel():
                raise ValueError(
                    f"sequence {i}: prompt_len={p} must leave >= 1 response token in a sequence of {ids.numel()}"
                )
        for name, value in self.extras.items():
            if value.shape[:1] != (s,):
                raise ValueError(f"extras[{name!r}] has shape {tuple(value.shape)}, expected ({s}, ...)")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def response_lens(self) -> torch.Tensor:
        """[S] int64: response tokens per sequence (L_k of docs/algorithm.md §3)."""
        return torch.tensor([ids.numel() for ids in self.input_ids], dtype=torch.long) - self.prompt_lens

    def select(self, index: torch.Tensor | list[int]) -> SequenceBatch:
        """Sub-batch with sequences ``index`` (order kept as given)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return SequenceBatch(
            input_ids=tuple(self.input_ids[i] for i in idx.tolist()),
            prompt_lens=self.prompt_lens[idx],
            extras={k: v[idx] for k, v in self.extras.items()},
        )

    def num_tokens(self) -> int:
        return sum(ids.numel() for ids in self.input_ids)


@dataclass(frozen=True)
class LogProbOutput:
    """Log-probs of the response tokens of S sequences, packed.

    token_logps: [N] float32, N = Σ response lengths; log π(y_t | x, y_<t) at the given temperature.
    cu_seqlens: [S + 1] int64, offsets of each sequence's response tokens in ``token_logps``.
    seq_logp_sum: [S] float32, Σ_t log π over each response (differentiable when training).
    seq_len: [S] int64, response token counts.
    """

    token_logps: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_logp_sum: torch.Tensor
    seq_len: torch.Tensor


#: loss_fn(logprobs, extras_of_this_micro_batch, update_index_m, global_num_sequences)
#:   -> (loss scalar already divided by the global normaliser, metrics {name: float}).
#: Summing the losses of all micro-batches of a mini-batch gives the full mini-batch loss.
LossFn = Callable[[LogProbOutput, dict[str, torch.Tensor], int, int], tuple[torch.Tensor, dict[str, float]]]
