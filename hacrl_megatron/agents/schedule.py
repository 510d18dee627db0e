"""Micro-batches and megatron-core's forward(-backward) schedule of a Megatron agent (log-probs and train).

Packing choice: **right-padded** ``[B, T_max]`` micro-batches with megatron-core's causal mask, not
THD packing. The local layer spec — the only one that runs on CPU — rejects ``PackedSeqParams``
(``DotProductAttention.forward`` asserts ``packed_seq_params is None``), and with right padding
and a causal mask the pad tokens sit after every real token, so they cannot change a real token's
output: no attention mask tensor is needed at all. The padding costs compute only; micro-batches
are formed from consecutive sequences as the trainer ordered them.

Log-probs from the last stage's output: :mod:`hacrl_megatron.agents.lm_head`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hacrl_megatron.agents.batch import LogProbOutput, SequenceBatch
from hacrl_megatron.agents.lm_head import LMHead, response_logprobs
from hacrl_megatron.algo.inputs import LossInputs


@dataclass(frozen=True)
class MicroBatch:
    """B sequences of a :class:`SequenceBatch`, right-padded for one forward pass.

    tokens, position_ids: [B, T_max] int64 (pad id 0 after each sequence's end).
    rows, cols: [N] int64, where in the logits each response token is predicted (row b, col t-1).
    targets: [N] int64, the response token ids.
    cu_seqlens: [B + 1] int64 offsets of each sequence's response tokens in the N axis.
    seq_len: [B] int64 response lengths.
    loss_inputs: the loss inputs of these B sequences (the loss function's slice), or None.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_len: torch.Tensor
    loss_inputs: LossInputs | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


def make_micro_batch(batch: SequenceBatch, device: torch.device | str = "cpu") -> MicroBatch:
    """Right-pad all sequences of ``batch`` into one :class:`MicroBatch`."""
    lens = [int(ids.numel()) for ids in batch.input_ids]
    b, t_max = len(lens), max(lens)
    tokens = torch.zeros(b, t_max, dtype=torch.long)
    rows, cols, targets = [], [], []
    for i, ids in enumerate(batch.input_ids):
        tokens[i, : lens[i]] = ids
        p = int(batch.prompt_lens[i])
        rows.append(torch.full((lens[i] - p,), i, dtype=torch.long))
        cols.append(torch.arange(p - 1, lens[i] - 1))
        targets.append(ids[p:].long())
    seq_len = batch.response_lens
    cu = torch.zeros(b + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(seq_len, 0)
    to = lambda x: x.to(device)  # noqa: E731
    return MicroBatch(
        tokens=to(tokens),
        position_ids=to(torch.arange(t_max).unsqueeze(0).expand(b, -1).contiguous()),
        rows=to(torch.cat(rows)),
        cols=to(torch.cat(cols)),
        targets=to(torch.cat(targets)),
        cu_seqlens=to(cu),
        seq_len=to(seq_len),
        loss_inputs=None if batch.loss_inputs is None else batch.loss_inputs.to(device),
    )


def split_micro_batches(batch: SequenceBatch, size: int, device: torch.device | str = "cpu") -> list[MicroBatch]:
    """Consecutive groups of ``size`` sequences (the last one may be smaller)."""
    if size < 1:
        raise ValueError(f"micro_batch_size={size} must be >= 1")
    n = len(batch)
    return [make_micro_batch(batch.select(list(range(i, min(i + size, n)))), device) for i in range(0, n, size)]


def dp_slice(n: int, dp: int, dp_rank: int) -> list[int]:
    """Sequence indices of data-parallel rank ``dp_rank`` (contiguous, sizes differ by at most 1)."""
    if n < dp:
        raise ValueError(f"a batch of {n} sequences cannot be split over data-parallel size {dp}")
    return torch.tensor_split(torch.arange(n), dp)[dp_rank].tolist()


def run_schedule(
    model: torch.nn.Module,
    micro_batches: list[MicroBatch],
    on_logprobs: Callable[[LogProbOutput, MicroBatch], torch.Tensor],
    temperature: float,
    head: LMHead,
    forward_only: bool,
) -> None:
    """Drive megatron-core's forward(-backward) schedule (no pipelining or 1F1B for PP > 1).

    ``on_logprobs(logprobs, micro_batch)`` runs on the last pipeline stage for every micro-batch and
    returns the loss to backpropagate (ignored when ``forward_only``). Losses are summed over
    micro-batches, not averaged (``calculate_per_token_loss=True`` and a 3-tuple loss function with
    no token-count rescaling in ``finalize_model_grads``, see ``LocalAgent``).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):  # noqa: ANN001 (megatron's callback signature)
        mb = next(data_iterator)
        output = chunk(mb.tokens, mb.position_ids, None)

        def loss_func(output_tensor: torch.Tensor):  # noqa: ANN202
            loss = on_logprobs(response_logprobs(output_tensor, mb, temperature, head), mb)
            return loss, torch.tensor(mb.seq_len.numel(), dtype=torch.int), {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
        micro_batch_size=max(mb.tokens.shape[0] for mb in micro_batches),
        forward_only=forward_only,
    )
