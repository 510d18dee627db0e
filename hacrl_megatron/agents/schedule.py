"""Micro-batches and megatron-core's forward(-backward) schedule of a Megatron agent (log-probs and train).

Two row layouts (docs/scaling.md):

* **Right-padded** ``[B, T_max]`` (:func:`make_micro_batch`), the default. With right padding and a
  causal mask the pad tokens sit after every real token, so they cannot change a real token's output:
  no attention mask tensor is needed at all. The padding costs compute only.
* **Packed** ``[1, T]`` (:func:`make_packed_micro_batch`, ``train.pack_sequences``): the sequences back to
  back in one row, positions restarting at 0 for each. Attention must not cross sequences: on GPU through
  Transformer Engine's THD path (``PackedSeqParams`` with ``cu_seqlens``: each sequence's own causal
  attention and RoPE); on CPU the local layer spec (whose ``DotProductAttention`` refuses
  ``PackedSeqParams``) gets an explicit block-diagonal causal mask ``[1, 1, T, T]`` and RoPE frequencies
  gathered at each token's own position (:func:`rope_at_positions`).

Which sequences form a micro-batch: ``train.micro_batch_size`` consecutive ones, or a token budget
(``train.max_tokens_per_microbatch``, :mod:`hacrl_megatron.agents.packing`). Under context parallelism
each rank runs its chunks of every row (:mod:`hacrl_megatron.agents.context_parallel`).
Log-probs from the last stage's output: :mod:`hacrl_megatron.agents.lm_head`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hacrl_megatron.agents.batch import LogProbOutput, SequenceBatch
from hacrl_megatron.agents.context_parallel import micro_batch_logprobs
from hacrl_megatron.agents.lm_head import LMHead
from hacrl_megatron.agents.packing import Geometry, MicroBatchPlan, round_up
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
    seq_index: [B] int64, each sequence's index in the batch it was cut from (where its log-probs go).
    filler: a micro-batch that only keeps data-parallel ranks' micro-batch counts equal
        (agents/packing.py): its loss counts zero and its log-probs are dropped.
    attention_mask: packed rows on CPU: [1, 1, T, T] bool, True where attention is blocked (megatron's
        convention): causal within each sequence, nothing across; None otherwise (causal is implied).
    packed_seq_params: packed rows through Transformer Engine (GPU): megatron's ``PackedSeqParams``
        (THD, cu_seqlens of the row's sequences); None otherwise.
    real_tokens: the sequences' own tokens (the rest of ``tokens`` is padding).
    context_parallel: under context parallelism, how the rows were split
        (``agents.context_parallel.ContextParallelSplit``): ``tokens`` and ``position_ids`` are then this
        rank's ``[B, T/cp]`` chunks, while rows/cols/targets/cu_seqlens/seq_len still describe the full
        rows (the log-probs every CP rank assembles); None otherwise.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_len: torch.Tensor
    loss_inputs: LossInputs | None = None
    seq_index: torch.Tensor | None = None
    filler: bool = False
    attention_mask: torch.Tensor | None = None
    packed_seq_params: Any = None
    real_tokens: int = 0
    context_parallel: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def row_len(self) -> int:
        """T of the full rows (before a context-parallel split): the sequence length megatron's schedule expects."""
        return self.tokens.shape[1] if self.context_parallel is None else self.context_parallel.row_len


def make_micro_batch(batch: SequenceBatch, device: torch.device | str = "cpu",
                     seq_index: list[int] | None = None) -> MicroBatch:
    """Right-pad all sequences of ``batch`` into one :class:`MicroBatch` (``seq_index``: their indices in
    the batch they were cut from; default 0..B-1)."""
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
        seq_index=torch.tensor(seq_index if seq_index is not None else range(b), dtype=torch.long),
        real_tokens=sum(lens),
    )


def make_packed_micro_batch(batch: SequenceBatch, device: torch.device | str = "cpu",
                            seq_index: list[int] | None = None, geometry: Geometry | None = None,
                            thd: bool = False) -> MicroBatch:
    """All sequences of ``batch`` back to back in one row ``[1, T]`` (:class:`MicroBatch`, packed).

    Sequence i occupies ``round_up(len_i, geometry.seq_multiple)`` slots from its start (its own tokens
    first, then pad); the row ends with pad up to a multiple of ``geometry.row_multiple``. Positions
    restart at 0 for every sequence. ``thd``: describe the row to Transformer Engine by ``cu_seqlens``
    (``packed_seq_params``; GPU); else build the block-diagonal causal ``attention_mask`` (CPU, local
    layer spec). Pad slots form blocks of their own: no real token attends to one.
    """
    geometry = geometry or Geometry(packed=True)
    lens = [int(ids.numel()) for ids in batch.input_ids]
    slots = [round_up(n, geometry.seq_multiple) for n in lens]
    starts = [sum(slots[:i]) for i in range(len(slots))]
    total = round_up(sum(slots), geometry.row_multiple)
    slots[-1] += total - sum(slots)  # the row's tail pad belongs to the last sequence's slot
    tokens = torch.zeros(1, total, dtype=torch.long)
    positions = torch.zeros(1, total, dtype=torch.long)
    block = torch.zeros(total, dtype=torch.long)  # which slot each position belongs to
    cols, targets = [], []
    for i, ids in enumerate(batch.input_ids):
        s0, n, p = starts[i], lens[i], int(batch.prompt_lens[i])
        tokens[0, s0 : s0 + n] = ids
        positions[0, s0 : s0 + slots[i]] = torch.arange(slots[i])
        block[s0 : s0 + slots[i]] = i
        cols.append(torch.arange(s0 + p - 1, s0 + n - 1))
        targets.append(ids[p:].long())
    # pad inside a slot (CP's per-sequence padding, the tail) sits after its sequence's tokens: causal
    # attention keeps it out of every real token's view, as right padding does.
    seq_len = batch.response_lens
    cu = torch.zeros(len(lens) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(seq_len, 0)
    mask, psp = None, None
    if thd:
        psp = _thd_params(lens, slots, device)
    else:
        causal = torch.ones(total, total, dtype=torch.bool).tril()
        mask = ~(causal & (block.unsqueeze(0) == block.unsqueeze(1)))
        mask = mask.view(1, 1, total, total).to(device)
    to = lambda x: x.to(device)  # noqa: E731
    n_tok = int(sum(len(c) for c in cols))
    return MicroBatch(
        tokens=to(tokens), position_ids=to(positions), rows=to(torch.zeros(n_tok, dtype=torch.long)),
        cols=to(torch.cat(cols)), targets=to(torch.cat(targets)), cu_seqlens=to(cu), seq_len=to(seq_len),
        loss_inputs=None if batch.loss_inputs is None else batch.loss_inputs.to(device),
        seq_index=torch.tensor(seq_index if seq_index is not None else range(len(lens)), dtype=torch.long),
        attention_mask=mask, packed_seq_params=psp, real_tokens=sum(lens),
    )


def _thd_params(lens: list[int], slots: list[int], device: torch.device | str) -> Any:
    """megatron's ``PackedSeqParams`` for one packed row: real lengths in ``cu_seqlens``, slot boundaries
    in ``cu_seqlens_*_padded`` (Transformer Engine's THD attention; int32 on the device)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    def cumulative(values: list[int]) -> torch.Tensor:
        out = torch.zeros(len(values) + 1, dtype=torch.int32)
        out[1:] = torch.cumsum(torch.tensor(values, dtype=torch.int32), 0)
        return out.to(device)

    real, padded = cumulative(lens), cumulative(slots)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=max(slots), max_seqlen_kv=max(slots))


def plan_micro_batches_of(batch: SequenceBatch, plan: MicroBatchPlan, rank: int, geometry: Geometry,
                          device: torch.device | str = "cpu", thd: bool = False) -> list[MicroBatch]:
    """Rank ``rank``'s micro-batches of ``plan`` (agents/packing.py), packed or padded as ``geometry`` says."""
    out = []
    for idx, filler in zip(plan.ranks[rank], plan.fillers[rank]):
        part = batch.select(list(idx))
        mb = (make_packed_micro_batch(part, device, list(idx), geometry, thd) if geometry.packed
              else make_micro_batch(part, device, list(idx)))
        out.append(dataclasses.replace(mb, filler=True) if filler else mb)
    return out


def pad_rows(mb: MicroBatch, multiple: int) -> MicroBatch:
    """Sequence (and context) parallelism split each row: a right-padded row's T padded to a multiple of
    ``multiple`` (``Geometry.row_multiple``; right padding after every real token changes no real token's
    output, module docstring). Packed rows are built to that length already: returned as they are."""
    b, t = mb.tokens.shape
    pad = -t % multiple
    if not pad or mb.attention_mask is not None or mb.packed_seq_params is not None:
        return mb
    tokens = torch.cat([mb.tokens, mb.tokens.new_zeros(b, pad)], dim=1)
    return dataclasses.replace(mb, tokens=tokens, position_ids=torch.arange(t + pad, device=tokens.device)
                               .unsqueeze(0).expand(b, -1).contiguous())


@contextlib.contextmanager
def rope_at_positions(model: torch.nn.Module, position_ids: torch.Tensor | None) -> Iterator[None]:
    """Inside the block, ``model``'s rotary embedding gives each token the frequencies of its own
    position (``position_ids`` [B, T]) instead of 0..T-1: packed sequences restart at 0 (CPU path).

    megatron's ``GPTModel`` computes RoPE once per forward from the sequence length alone and ignores
    ``position_ids``; its bshd RoPE multiplies ``[T, B, heads, dim]`` by frequencies ``[T, 1, 1, dim]``,
    so frequencies ``[T, B, 1, dim]`` gathered per token broadcast the same way. Recomputed layers reuse
    the frequencies of the forward (they are an argument of each layer), so the block may close before
    the backward.
    """
    rope = getattr(model, "rotary_pos_emb", None)
    if position_ids is None or rope is None:
        yield
        return
    plain = rope.forward

    def at_positions(max_seq_len: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        emb = plain(int(position_ids.max()) + 1, *args, **kwargs)  # [P, 1, 1, dim]
        return emb[position_ids.t()].squeeze(3)  # [T, B, 1, dim]

    rope.forward = at_positions
    try:
        yield
    finally:
        del rope.forward  # the class's forward again


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

    from hacrl_megatron.models.convert import unwrap

    def forward_step(data_iterator, chunk):  # noqa: ANN001 (megatron's callback signature)
        mb = next(data_iterator)
        extra = {} if mb.packed_seq_params is None else {"packed_seq_params": mb.packed_seq_params}
        with rope_at_positions(unwrap(chunk), mb.position_ids if mb.attention_mask is not None else None):
            output = chunk(mb.tokens, mb.position_ids, mb.attention_mask, **extra)

        def loss_func(output_tensor: torch.Tensor):  # noqa: ANN202
            loss = on_logprobs(micro_batch_logprobs(output_tensor, mb, temperature, head), mb)
            return loss, torch.tensor(mb.seq_len.numel(), dtype=torch.int), {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=max(mb.row_len for mb in micro_batches),
        micro_batch_size=max(mb.tokens.shape[0] for mb in micro_batches),
        forward_only=forward_only,
    )
