"""The post-sync check every transport is held to: the engine scores a probe sequence as the trainer does.

After every sync, whatever the transport (in-process copy, disk, tensor, distributed), the engine
must give the same Σ log-prob of a fixed probe response as the trainer, up to fp32 kernel
differences (:func:`check_sync`); a wrong name map, a missing tensor or a stale engine shows at once.
"""

from __future__ import annotations

import torch

from hacrl_megatron.agents.batch import SequenceBatch
from hacrl_megatron.agents.handle import AgentHandle
from hacrl_megatron.rollout.types import TrainingEngine

# |Σ log π_engine − Σ log π_trainer| allowed per probe token: two fp32 implementations of the same
# network (HF vs Megatron kernels) differ by ~1e-6 per token; a wrong or missing tensor by >> 1e-2.
SYNC_TOLERANCE_PER_TOKEN = 1e-3


class WeightSyncError(RuntimeError):
    """The engine does not compute what the trainer computes after a weight sync."""


def check_sync(agent: AgentHandle, engine: TrainingEngine, prompt_ids: list[int], response_ids: list[int],
               tolerance_per_token: float = SYNC_TOLERANCE_PER_TOKEN) -> float:
    """|engine − trainer| Σ log-prob of ``response_ids`` after ``prompt_ids`` at temperature 1.

    Temperature 1 because a weight check needs none and SGLang reports only the raw model's input
    log-probs. Raises :class:`WeightSyncError` when the difference exceeds
    ``tolerance_per_token × len(response_ids)``.
    """
    trainer_sum = trainer_logprob(agent, prompt_ids, response_ids)
    return compare_logprobs(agent.name, trainer_sum, engine.sequence_logprob(list(prompt_ids), list(response_ids)),
                            len(response_ids), tolerance_per_token)


def trainer_logprob(agent: AgentHandle, prompt_ids: list[int], response_ids: list[int]) -> float:
    """The trainer's half of :func:`check_sync` (colocated runs score it before the engines' KV cache
    comes back, trainer/colocation.py)."""
    batch = SequenceBatch(
        input_ids=(torch.tensor(list(prompt_ids) + list(response_ids), dtype=torch.long),),
        prompt_lens=torch.tensor([len(prompt_ids)]),
    )
    trainer_sum, _ = agent.sequence_logprobs(batch, 1.0)
    return float(trainer_sum[0])


def compare_logprobs(name: str, trainer_sum: float, engine_sum: float, response_len: int,
                     tolerance_per_token: float = SYNC_TOLERANCE_PER_TOKEN) -> float:
    """|engine_sum − trainer_sum| (nats); :class:`WeightSyncError` above ``tolerance_per_token × response_len``."""
    diff = abs(trainer_sum - engine_sum)
    if diff > tolerance_per_token * response_len:
        raise WeightSyncError(
            f"agent {name!r}: after weight sync the engine's log-prob of the probe sequence is {engine_sum:.6f}, "
            f"the trainer's {trainer_sum:.6f} (|diff| {diff:.2e} > {tolerance_per_token:g}/token)"
        )
    return diff
