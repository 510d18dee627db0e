"""How the last pipeline stage turns its output into response log-probs (the LM head).

Log-probs: position t's logits predict token t+1, so the response tokens ``ids[p:T]`` of a sequence
with prompt length p are scored by the logits at positions ``p-1 .. T-2``. Only those N rows are
gathered from the model output before the log-softmax (:func:`response_logprobs`). By default the
model returns hidden states and ``hacrl_megatron.kernels.sequence_logprobs`` computes the log-probs
from hidden × LM head in vocabulary chunks, so [B, T, V] logits never exist (a 150k vocabulary
would otherwise dominate activation memory); ``LMHead(impl="megatron")`` keeps megatron's logits
and ``vocab_parallel_cross_entropy``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from hacrl_megatron.agents.batch import LogProbOutput
from hacrl_megatron.kernels import sequence_logprobs


class ScoredRows(Protocol):
    """Where a micro-batch's response tokens sit in the model output (agents/schedule.MicroBatch).

    rows, cols: [N] int64, the output row and column that predicts each response token.
    targets: [N] int64 token ids; cu_seqlens: [S + 1] offsets in N; seq_len: [S] response lengths.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_len: torch.Tensor


@dataclass(frozen=True)
class LMHead:
    """How the last stage turns its output into log-probs.

    impl: "megatron" — the model returns vocab-parallel logits and megatron's
        ``vocab_parallel_cross_entropy`` gives the target log-probs; otherwise the model returns
        final hidden states (see :func:`install_hidden_head`) and ``hacrl_megatron.kernels``'
        ``sequence_logprobs`` with this ``impl`` ("auto" | "reference" | "triton") computes them
        from hidden × LM-head weight without materialising [N, V] logits.
    weight: callable returning this rank's LM-head weight shard [V_pad/tp, H] (kernel path).
    """

    impl: str
    vocab_size: int
    weight: Callable[[], torch.Tensor] | None = None
    tp_group: object = None


def install_hidden_head(model: torch.nn.Module) -> None:
    """Make ``GPTModel`` return final hidden states [B, T, H] instead of logits on the last stage.

    ``GPTModel._postprocess`` calls ``output_layer(hidden, weight=...)`` and returns the result
    transposed to batch-first; a pass-through there hands the kernel the hidden states. No TP
    region op is applied: the kernel all-reduces dH over the TP group itself (and the forward's
    hidden states are already replicated across TP ranks without sequence parallelism).
    """
    layer = model.output_layer

    def passthrough(hidden: torch.Tensor, weight: torch.Tensor | None = None, **kwargs: object) -> tuple:
        return hidden, None

    layer.forward = passthrough


def response_logprobs(output: torch.Tensor, mb: ScoredRows, temperature: float, head: LMHead) -> LogProbOutput:
    """Per-token log π(y_t) of the response tokens at ``temperature`` (logits / T, docs/algorithm.md §3).

    output: the last stage's model output, [B, T, V_pad/tp] logits ("megatron") or [B, T, H]
        hidden states (kernel path); only the N rows that predict response tokens are used.
    Padded vocabulary rows (Megatron's ``V_pad`` > the HF vocab) never receive probability.
    Returns token log-probs [N] (float32, differentiable), per-sequence sums [S] and counts [S].
    """
    rows = output[mb.rows, mb.cols]
    if head.impl != "megatron":
        out = sequence_logprobs(rows, head.weight(), mb.targets, mb.cu_seqlens, temperature=temperature,
                                tp_group=head.tp_group, impl=head.impl, vocab_size=head.vocab_size)
        return LogProbOutput(token_logps=out.token_logps, cu_seqlens=mb.cu_seqlens,
                             seq_logp_sum=out.seq_logp_sum, seq_len=mb.seq_len)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    local = rows.float() / temperature  # [N, V_pad/tp]
    start = mpu.get_tensor_model_parallel_rank() * local.shape[-1]
    if start + local.shape[-1] > head.vocab_size:  # Megatron vocab padding: never a valid token
        pad = torch.arange(start, start + local.shape[-1], device=local.device) >= head.vocab_size
        local = local.masked_fill(pad, float("-inf"))
    token_logps = -vocab_parallel_cross_entropy(local, mb.targets)
    seq_ids = torch.repeat_interleave(torch.arange(len(mb.seq_len), device=local.device), mb.seq_len)
    sums = torch.zeros(len(mb.seq_len), dtype=token_logps.dtype, device=local.device).index_add(0, seq_ids, token_logps)
    return LogProbOutput(token_logps=token_logps, cu_seqlens=mb.cu_seqlens, seq_logp_sum=sums, seq_len=mb.seq_len)
