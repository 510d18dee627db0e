"""How the last pipeline stage turns its output into response log-probs (the LM head).

Log-probs: position t's logits predict token t+1, so the response tokens ``ids[p:T]`` of a sequence
with prompt length p are scored by the logits at positions ``p-1 .. T-2``. Only those N rows are
taken from the model output before the log-softmax (:func:`response_logprobs`). Which path computes
them is decided by :func:`hacrl_megatron.agents.logprob_path.logprob_path` (the planner asks the
same function): by default the model returns hidden states and ``hacrl_megatron.kernels.sequence_logprobs``
computes the log-probs from hidden × LM head in vocabulary chunks, so [B, T, V] logits never exist
(a 150k vocabulary would otherwise dominate activation memory), with or without sequence
parallelism (:func:`gather_scored_rows`); ``logprob_impl="megatron"`` keeps megatron's logits and
``vocab_parallel_cross_entropy``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hacrl_megatron.agents import logprob_path as paths
from hacrl_megatron.agents.batch import LogProbOutput
from hacrl_megatron.kernels import sequence_logprobs


class ScoredRows(Protocol):
    """Where a micro-batch's response tokens sit in the model output (agents/schedule.MicroBatch).

    rows, cols: [N] int64, the output row and column (position in the whole padded row of T) that
    predicts each response token. targets: [N] int64 token ids; cu_seqlens: [S + 1] offsets in N;
    seq_len: [S] response lengths.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_len: torch.Tensor


@dataclass(frozen=True)
class LMHead:
    """How the last stage turns its output into log-probs.

    path: the :class:`LogProbPath` — ``megatron``: the model returns vocab-parallel logits and
        megatron's ``vocab_parallel_cross_entropy`` gives the target log-probs; ``fused``: the model
        returns final hidden states (see :func:`install_hidden_head`) and ``hacrl_megatron.kernels``'
        ``sequence_logprobs`` (backend ``path.kernel_impl``) computes them from hidden × LM-head
        weight without materialising [N, V] logits.
    vocab_size: the real (HF) vocabulary; Megatron's padding rows beyond it get no probability.
    weight: callable returning this rank's LM-head weight shard [V_pad/tp, H] (fused path).
    tp_group: the tensor-parallel group (fused path with tp > 1): the kernel's vocab-parallel
        reductions, and the scored rows' all-gather under sequence parallelism.
    """

    path: paths.LogProbPath
    vocab_size: int
    weight: Callable[[], torch.Tensor] | None = None
    tp_group: object = None

    @property
    def impl(self) -> str:
        """The ``logprob_impl`` this head runs: the kernel backend, or "megatron"."""
        return self.path.kernel_impl or "megatron"


def build_lm_head(model: Any, impl: str, *, vocab_size: int, tp: int, sequence_parallel: bool) -> LMHead:
    """The head of ``model`` (this rank's ``GPTModel`` stage) for ``logprob_impl=impl``.

    On the fused path the last stage's output layer becomes a pass-through (:func:`install_hidden_head`).
    ``sequence_parallel``: as configured; it takes effect only with tp > 1 (megatron's rule).
    """
    path = paths.logprob_path(impl, sequence_parallel and tp > 1)
    if path.materialises_logits:
        return LMHead(path, vocab_size)
    from megatron.core import parallel_state as mpu

    if model.post_process:
        install_hidden_head(model)
    tied = model.share_embeddings_and_output_weights

    def weight() -> torch.Tensor:
        return model.shared_embedding_or_output_weight() if tied else model.output_layer.weight

    group = mpu.get_tensor_model_parallel_group() if tp > 1 else None
    return LMHead(path, vocab_size, weight, group)


def install_hidden_head(model: torch.nn.Module) -> None:
    """Make ``GPTModel`` return final hidden states instead of logits on the last stage.

    ``GPTModel._postprocess`` calls ``output_layer(hidden, weight=...)`` and returns the result
    transposed to batch-first; a pass-through there hands the kernel the hidden states: [B, T, H],
    or [B, T/tp, H] (this rank's slice of the sequence) under sequence parallelism. No TP region op
    is applied: the kernel all-reduces dH over the TP group itself, and without sequence parallelism
    the hidden states are already replicated across TP ranks.
    """
    layer = model.output_layer

    def passthrough(hidden: torch.Tensor, weight: torch.Tensor | None = None, **kwargs: object) -> tuple:
        return hidden, None

    layer.forward = passthrough


def gather_scored_rows(hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, group: Any) -> torch.Tensor:
    """The hidden states [N, H] of the scored positions, from sequence-parallel shards, on every TP rank.

    hidden: [B, T/tp, H], this rank's contiguous slice of the sequence (rank r holds positions
        [r·T/tp, (r+1)·T/tp); megatron's sequence-parallel split of a padded or packed row).
    rows, cols: [N] int64, batch row and global position of each scored token (the same on every rank).

    Each rank contributes only the scored rows it holds, padded to the largest count, so the
    all-gather moves [tp·n_max, H] rather than the whole [T, B, H] sequence. Backward: the kernel
    already all-reduced dH over the TP group (every rank holds the complete gradient of all N rows),
    so the gather's backward must only *split* — each rank keeps the gradient of its own rows
    (megatron's ``gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)``). Its
    default, a reduce-scatter, would sum the tp identical copies and scale the gradient by tp.
    """
    import torch.distributed as dist
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = hidden.shape[1]
    owner = torch.div(cols, shard, rounding_mode="floor")  # [N] the rank holding each scored position
    counts = torch.bincount(owner, minlength=world)
    if counts.numel() != world:
        raise ValueError(f"scored position {int(cols.max())} lies past the sequence of {shard} × tp={world}")
    width = int(counts.max())
    mine = owner == rank
    local = hidden[rows[mine], cols[mine] - rank * shard]  # [n_rank, H], in N order
    block = torch.cat([local, local.new_zeros(width - local.shape[0], local.shape[1])])
    gathered = gather_from_sequence_parallel_region(block, tensor_parallel_output_grad=False, group=group)
    # token i is the k-th scored position of its owner (N order): slot owner·width + k of the gather
    order = torch.argsort(owner, stable=True)
    first = torch.cumsum(counts, 0) - counts
    k = torch.empty_like(owner)
    k[order] = torch.arange(owner.numel(), device=owner.device) - first[owner[order]]
    return gathered[owner * width + k]


def scored_hidden(output: torch.Tensor, mb: ScoredRows, head: LMHead) -> torch.Tensor:
    """[N, H] hidden states of the scored positions from the fused path's model output."""
    if head.path.gather_rows:
        return gather_scored_rows(output, mb.rows, mb.cols, head.tp_group)
    return output[mb.rows, mb.cols]


def response_logprobs(output: torch.Tensor, mb: ScoredRows, temperature: float, head: LMHead) -> LogProbOutput:
    """Per-token log π(y_t) of the response tokens at ``temperature`` (logits / T, docs/algorithm.md §3).

    output: the last stage's model output, [B, T, V_pad/tp] logits ("megatron") or [B, T, H]
        hidden states (fused path; [B, T/tp, H] under sequence parallelism); only the N rows that
        predict response tokens are used.
    Padded vocabulary rows (Megatron's ``V_pad`` > the HF vocab) never receive probability.
    Returns token log-probs [N] (float32, differentiable), per-sequence sums [S] and counts [S].
    """
    if not head.path.materialises_logits:
        out = sequence_logprobs(scored_hidden(output, mb, head), head.weight(), mb.targets, mb.cu_seqlens,
                                temperature=temperature, tp_group=head.tp_group, impl=head.path.kernel_impl,
                                vocab_size=head.vocab_size)
        return LogProbOutput(token_logps=out.token_logps, cu_seqlens=mb.cu_seqlens,
                             seq_logp_sum=out.seq_logp_sum, seq_len=mb.seq_len)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    local = output[mb.rows, mb.cols].float() / temperature  # [N, V_pad/tp]
    start = mpu.get_tensor_model_parallel_rank() * local.shape[-1]
    if start + local.shape[-1] > head.vocab_size:  # Megatron vocab padding: never a valid token
        pad = torch.arange(start, start + local.shape[-1], device=local.device) >= head.vocab_size
        local = local.masked_fill(pad, float("-inf"))
    token_logps = -vocab_parallel_cross_entropy(local, mb.targets)
    seq_ids = torch.repeat_interleave(torch.arange(len(mb.seq_len), device=local.device), mb.seq_len)
    sums = torch.zeros(len(mb.seq_len), dtype=token_logps.dtype, device=local.device).index_add(0, seq_ids, token_logps)
    return LogProbOutput(token_logps=token_logps, cu_seqlens=mb.cu_seqlens, seq_logp_sum=sums, seq_len=mb.seq_len)
