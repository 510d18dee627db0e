"""Records that cross the trainer ↔ agent boundary.

A :class:`SequenceBatch` holds whole token sequences (prompt + response, in the learner's own
tokenizer) and the loss's per-sequence :class:`~hacrl_megatron.algo.LossInputs`. An agent turns it
into a :class:`LogProbOutput`, the per-token log-probs of the response tokens, and hands that to a
:data:`LossFn` together with the matching slice of the inputs and the mini-batch's
:class:`MiniBatchInfo`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hacrl_megatron.algo.inputs import LossInputs


@dataclass(frozen=True)
class SequenceBatch:
    """S sequences in one learner's tokenizer.

    input_ids: S tensors of shape [T_s] (int64), prompt tokens followed by response tokens.
    prompt_lens: [S] int64, number of prompt tokens of each sequence (response starts there).
    loss_inputs: the S sequences' per-sequence loss inputs (advantages, is_self, ...), sliced with
        the sequences and passed to the loss unchanged; None for a loss that needs none (SFT).
    """

    input_ids: tuple[torch.Tensor, ...]
    prompt_lens: torch.Tensor
    loss_inputs: LossInputs | None = None

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
        if self.loss_inputs is not None and len(self.loss_inputs) != s:
            raise ValueError(f"loss_inputs hold {len(self.loss_inputs)} sequences, the batch has {s}")

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
            loss_inputs=None if self.loss_inputs is None else self.loss_inputs.select(idx),
        )

    def num_tokens(self) -> int:
        return sum(ids.numel() for ids in self.input_ids)

    def info(self, update_index: int) -> MiniBatchInfo:
        """This batch as mini-batch ``update_index``: its (global) sequence and response-token counts."""
        return MiniBatchInfo(update_index, len(self), int(self.response_lens.sum()))


@dataclass(frozen=True)
class MiniBatchInfo:
    """What every micro-batch's loss needs to know about its whole mini-batch.

    update_index: m, optimizer updates already made by this learner in this step (eq. 14).
    num_sequences: sequences of the whole mini-batch (all micro-batches and data-parallel ranks):
        the sequence-level losses' normaliser (docs/algorithm.md §7).
    num_tokens: response tokens of the whole mini-batch: GRPO's token-mean normaliser.
    """

    update_index: int
    num_sequences: int
    num_tokens: int


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


#: loss_fn(logprobs, loss_inputs_of_this_micro_batch, mini_batch_info)
#:   -> (loss scalar already divided by the global normaliser, metrics {name: float}).
#: Summing the losses of all micro-batches of a mini-batch gives the full mini-batch loss.
LossFn = Callable[[LogProbOutput, LossInputs | None, MiniBatchInfo], tuple[torch.Tensor, dict[str, float]]]


def mean_over_micro_batches(records: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The update's metrics from its micro-batches' (metrics, sequence count) records: each key's mean over the
    micro-batches that report it, weighted by their sequences (a per-sequence mean, whatever the
    micro-batching). A key a micro-batch leaves out (no sequence of that pair, family or sign in it) is not
    counted there as 0."""
    out: dict[str, float] = {}
    for key in sorted({k for metrics, _ in records for k in metrics}):
        reports = [(metrics[key], n) for metrics, n in records if key in metrics]
        out[key] = sum(v * n for v, n in reports) / sum(n for _, n in reports)
    return out
