"""The AgentHandle protocol: everything the HACRL loop asks of one agent.

Implementations: :class:`~hacrl_megatron.agents.local.LocalAgent` (megatron-core in the controller
process: tests, the CPU demo), :class:`~hacrl_megatron.agents.ray_agent.RayAgent` (an agent's
TP×PP×DP ranks as Ray actors in their own world: clusters, mixed layouts) and
:class:`~hacrl_megatron.agents.hf.HFAgent` (plain transformers, the reference). The loop never knows
which implementation it drives.

Training can overlap across agents: :meth:`AgentHandle.train_async` returns a
:class:`PendingResult` at once. Agents whose ranks run elsewhere (Ray) start the update and return;
agents that run in the calling process finish it first and return a :class:`CompletedResult`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

import torch

from hacrl_megatron.agents.batch import LogProbOutput, LossFn, SequenceBatch

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class PendingResult(Protocol[T_co]):
    """A call that may still be running; :meth:`result` waits for it and returns its value."""

    def result(self) -> T_co:
        """Wait for the call and return its value (re-raising its error)."""


@dataclass(frozen=True)
class CompletedResult(Generic[T]):
    """A :class:`PendingResult` of a call that already finished in this process."""

    value: T

    def result(self) -> T:
        return self.value


@runtime_checkable
class AgentHandle(Protocol):
    name: str

    def sequence_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """No-grad per-sequence Σ log π of the response tokens [S] (float32) and token counts [S]."""

    def token_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> LogProbOutput:
        """No-grad per-token log-probs of the response tokens, packed (GRPO's π_old)."""

    def keep_reference(self) -> None:
        """Keep the current weights as the frozen reference of the KL penalty (a host copy of each rank's
        shard, agents/reference.py); called once when the run builds the agent, before any resume."""

    def reference_token_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> LogProbOutput:
        """:meth:`token_logprobs` under the weights :meth:`keep_reference` kept (the KL's π_ref)."""

    def keep_version(self, version: int) -> None:
        """Snapshot the current weights (a host copy of each rank's shard) as weight version ``version``,
        for the behaviour pass of rollouts that version samples while training goes on (§7b)."""

    def drop_versions(self, below: int) -> None:
        """Free the snapshots of versions older than ``below``."""

    def sequence_logprobs_at(self, version: int, batch: SequenceBatch,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sequence_logprobs` under the weights of snapshot ``version`` (the behaviour policy)."""

    def train(self, mini_batches: list[SequenceBatch], loss_fn: LossFn, temperature: float = 1.0) -> list[dict[str, float]]:
        """One optimizer update per mini-batch (m = 0..M−1, in order); returns one metrics dict each."""

    def train_async(self, mini_batches: list[SequenceBatch], loss_fn: LossFn,
                    temperature: float = 1.0) -> PendingResult[list[dict[str, float]]]:
        """:meth:`train` without waiting where the agent's ranks run elsewhere, so that agents on
        disjoint resources update concurrently; ``.result()`` gives :meth:`train`'s metrics."""

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors (gathered across TP/PP), streamed one at a time."""

    def sleep(self, level: str) -> None:
        """Move the agent's GPU state to host memory on every rank, so that colocated engines can use the
        GPUs (agents/offload.py): ``optimizer`` (optimizer state, fp32 main weights, gradients; the weights
        stay for the export), ``all`` (the weights too) or ``none`` (nothing). Deeper levels only add."""

    def wake(self) -> None:
        """Bring back, bit-identical and into the same tensors, what :meth:`sleep` moved."""

    def save(self, path: str) -> dict[str, dict]:
        """Write model + optimizer + scheduler state under ``path`` (a directory that may not exist);
        :meth:`begin_save` then :meth:`end_save`."""

    def begin_save(self, path: str, background: bool = False) -> None:
        """Start :meth:`save`: return once the state is copied for a writer (device → host memory), which
        then writes it while the caller goes on. ``background``: the agent trains before :meth:`end_save`,
        so state that the writer would otherwise read in place is copied too (a clone on CPU)."""

    def end_save(self) -> dict[str, dict]:
        """Wait for the save :meth:`begin_save` started and complete it; return every file written,
        path relative to ``path`` → ``{"size": bytes, "sha256": hex}``, hashed as it was written."""

    def load(self, path: str, expected: dict[str, dict] | None = None) -> None:
        """Restore what :meth:`save` wrote; ``expected`` (:meth:`end_save`'s digests, from the manifest):
        hash every file as it is read and raise ``DamagedCheckpointError`` naming one that differs."""

    def stats(self) -> dict[str, float]:
        """Memory and timing counters (tokens/s of the last train/logprob calls, peak memory)."""

    def close(self) -> None:
        """Release what the agent holds outside this process (worker actors, placement); idempotent."""
