"""Right-padding or packing of a :class:`SequenceBatch` and response log-probs from full logits.

Used by agents whose model returns logits for a padded batch (the plain-torch HF agent, and as
the reference the Megatron agent is compared with). Shapes: S sequences, T = longest sequence
(padded) or the sum of their lengths (one packed row, :func:`pack_row`).
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


def pack_row(batch: SequenceBatch, mask_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """All sequences of ``batch`` back to back in one row, for a transformers model.

    Returns input_ids [1, T] int64, position_ids [1, T] int64 (restarting at 0 for each sequence, so
    RoPE sees every sequence from its own start), an additive attention mask [1, 1, T, T] of
    ``mask_dtype`` (0 where a token may attend: earlier tokens of its own sequence; the dtype's
    minimum elsewhere; transformers uses a 4-D mask as given, eager and SDPA alike) and each
    sequence's start [S] int64. T = Σ lengths.
    """
    lengths = [ids.numel() for ids in batch.input_ids]
    starts = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))], dtype=torch.long)
    input_ids = torch.cat(list(batch.input_ids)).long().unsqueeze(0)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    total = int(seq.numel())
    allowed = torch.ones(total, total, dtype=torch.bool).tril() & (seq.unsqueeze(0) == seq.unsqueeze(1))
    mask = torch.zeros(total, total, dtype=mask_dtype).masked_fill(~allowed, torch.finfo(mask_dtype).min)
    return input_ids, position_ids, mask.view(1, 1, total, total), starts


def response_logprobs_from_logits(logits: torch.Tensor, batch: SequenceBatch, temperature: float,
                                  starts: torch.Tensor | None = None) -> LogProbOutput:
    """Per-token log π(y_t | ·) of each response at ``temperature``, packed (fp32).

    logits: [S, T, V] from a right-padded batch (position t predicts token t + 1), or [1, T, V] from
    one packed row with each sequence beginning at ``starts`` [S] (:func:`pack_row`).
    Only [S, T−1] target positions are gathered; the log-softmax runs in fp32 per sequence so the
    full fp32 [S, T, V] tensor is never built at once.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: log-probs need a temperature > 0")
    pieces, sums = [], []
    for i, ids in enumerate(batch.input_ids):
        start, end = int(batch.prompt_lens[i]), ids.numel()
        # logits at positions start−1 .. end−2 predict tokens start .. end−1 (the response)
        row_index, offset = (i, 0) if starts is None else (0, int(starts[i]))
        row = logits[row_index, offset + start - 1 : offset + end - 1].float() / temperature
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
