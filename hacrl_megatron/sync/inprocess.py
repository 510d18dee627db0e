"""Trainer → engine weight sync inside one process, and its check (docs/architecture.md, "Weight sync").

The agent streams HF-named full tensors (gathered across TP/PP for Megatron agents) and the engine
copies them in place. After a sync the engine must score a fixed probe sequence exactly as the
trainer does (up to fp32 kernel differences); :func:`check_sync` measures that.
"""

from __future__ import annotations

import torch

from hacrl_megatron.agents.batch import SequenceBatch

# |Σ log π_engine − Σ log π_trainer| allowed per probe token: two fp32 implementations of the same
# network (HF vs Megatron kernels) differ by ~1e-6 per token; a wrong or missing tensor by >> 1e-2.
SYNC_TOLERANCE_PER_TOKEN = 1e-3


class WeightSyncError(RuntimeError):
    """The engine does not compute what the trainer computes after a weight sync."""


def sync_weights(agent, engine) -> int:
    """Push ``agent``'s HF-named weights into ``engine``; returns the number of tensors copied."""
    return engine.load_weights(agent.export_hf_weights())


def check_sync(agent, engine, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> float | None:
    """|engine − trainer| Σ log-prob of ``response_ids`` after ``prompt_ids``; raises WeightSyncError
    when it exceeds :data:`SYNC_TOLERANCE_PER_TOKEN` per token. Engines without an in-process
    model (SGLang servers acknowledge each update themselves) return None."""
    from hacrl_megatron.rollout.hf_engine import hf_sequence_logprob

    if getattr(engine, "model", None) is None:
        return None
    batch = SequenceBatch(
        input_ids=(torch.tensor(list(prompt_ids) + list(response_ids), dtype=torch.long),),
        prompt_lens=torch.tensor([len(prompt_ids)]),
    )
    trainer_sum, _ = agent.sequence_logprobs(batch, temperature)
    engine_sum = hf_sequence_logprob(engine.model, list(prompt_ids), list(response_ids), temperature)
    diff = abs(float(trainer_sum[0]) - engine_sum)
    if diff > SYNC_TOLERANCE_PER_TOKEN * len(response_ids):
        raise WeightSyncError(
            f"agent {agent.name!r}: after weight sync the engine's log-prob of the probe sequence is {engine_sum:.6f}, "
            f"the trainer's {float(trainer_sum[0]):.6f} (|diff| {diff:.2e} > {SYNC_TOLERANCE_PER_TOKEN:g}/token)"
        )
    return diff
