"""Right-padding of a :class:`SequenceBatch` and response log-probs from full logits.

Used by agents whose model returns logits for a padded batch (the plain-torch HF agent, and as
the reference the Megatron agent is compared with). Shapes: S sequences, T = longest sequence.
"""

from __future__ import annotations

import torch

from hacrl_megatron.agents.batch import LogProbOutput, SequenceBatch


def pad_right(batch: SequenceBatch, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [S, T] int64 padded with ``pad_id`` and attention_mask [S, T] int64 (1 = real)."""
    lengths = [ids.numel() for ids in batch.input_ids]
    width = max(lengths)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, ids in enumerate(batch.input_ids):
        input_ids[i, : ids.numel()] = ids
        mask[i, : ids.numel()] = 1
    return input_ids, mask


def response_logprobs_from_logits(logits: torch.Tensor, batch: SequenceBatch, temperature: float) -> LogProbOutput:
    """Per-token log π(y_t | ·) of each response at ``temperature``, packed (fp32).

    logits: [S, T, V] from a right-padded batch (position t predicts token t + 1).
    Only [S, T−1] target positions are gathered; the log-softmax runs in fp32 per sequence so the
    full fp32 [S, T, V] tensor is never built at once.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: log-probs need a temperature > 0")
    pieces, sums = [], []
    for i, ids in enumerate(batch.input_ids):
        start, end = int(batch.prompt_lens[i]), ids.numel()
        # logits at positions start−1 .. end−2 predict tokens start .. end−1 (the response)
        row = logits[i, start - 1 : end - 1].float() / temperature
        logp = torch.log_softmax(row, dim=-1).gather(-1, ids[start:end].view(-1, 1)).squeeze(-1)
        pieces.append(logp)
        sums.append(logp.sum())
    lens = batch.response_lens
    cu = torch.zeros(len(batch) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lens, 0)
    return LogProbOutput(
        token_logps=torch.cat(pieces) if pieces else torch.zeros(0),
        cu_seqlens=cu,
        seq_logp_sum=torch.stack(sums) if sums else torch.zeros(0),
        seq_len=lens,
    )


def micro_batches(batch: SequenceBatch, size: int) -> list[SequenceBatch]:
    """Consecutive chunks of at most ``size`` sequences (the last one may be smaller)."""
    if size < 1:
        raise ValueError(f"micro-batch size {size} must be >= 1")
    return [batch.select(list(range(i, min(i + size, len(batch))))) for i in range(0, len(batch), size)]
