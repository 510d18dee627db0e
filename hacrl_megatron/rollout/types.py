"""The records of a rollout (sampling parameters, completions) and what the trainer and the evaluator
need of an engine (no heavy imports: torch only for type hints). The seam between the engine pool,
its engine clients and the weight transports is in :mod:`~hacrl_megatron.rollout.protocol`."""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

COMPLETION_FINISH_REASONS = ("eos", "length", "stop")
_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seeds(base: int | None, count: int) -> list[int]:
    """``count`` distinct non-negative 63-bit seeds, one per sample (``EngineClient.generate_seeded``).

    Entry k of a call with seed ``base`` gets ``splitmix64(base · 2³² + k)`` (a bijection, so
    entries never share a seed and calls with nearby ``base`` — consecutive steps — do not share
    seeds either). ``base`` None draws a fresh random base: distinct, not reproducible.
    """
    if base is None:
        base = secrets.randbits(31)
    start = (int(base) & 0xFFFFFFFF) << 32
    return [_splitmix64(start + k) & _MASK63 for k in range(count)]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; one instance serves every prompt of a ``generate`` call.

    Fields:
        n: completions per prompt (G in docs/algorithm.md; GSPO×2 uses 2G).
        temperature: softmax temperature; 0 means greedy (argmax) decoding. The trainer computes
            old log-probs at this same temperature (docs/algorithm.md §3).
        top_p: nucleus mass in (0, 1]; 1 samples from the full distribution (paper setting).
        max_new_tokens: token budget per completion (max_response_len, docs/algorithm.md §6).
        stop_token_ids: extra ids that end a completion like eos (finish_reason "stop").
        stop: strings that end a completion once they appear in its text (finish_reason "stop").
        seed: with a seed, a call's results are reproducible on the same engine and hardware.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n!r}: must be an integer >= 1")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature={self.temperature!r}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r}: must lie in (0, 1]")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r}: must be an integer >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.stop, str):
            raise ValueError(f"SamplingParams.stop={self.stop!r}: must be a sequence of strings, not one string")
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not s for s in self.stop):
            raise ValueError(f"SamplingParams.stop={self.stop!r}: stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Completion:
    """One sampled response.

    Fields:
        token_ids: the response ids in the engine's tokenizer. They do **not** include the eos or
            stop token that ended the response (finish_reason carries that); a stop *string* is
            kept (its tokens are ordinary text tokens). No eos ever appears inside token_ids.
        text: ``decode(token_ids, skip_special_tokens=True)``.
        finish_reason: "eos" — the model produced its eos; "stop" — a stop token id or stop
            string; "length" — max_new_tokens reached.
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str

    def __post_init__(self) -> None:
        if self.finish_reason not in COMPLETION_FINISH_REASONS:
            raise ValueError(
                f"Completion.finish_reason={self.finish_reason!r}: must be one of {list(COMPLETION_FINISH_REASONS)}"
            )


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer and the evaluator need from an inference engine (HF on CPU, SGLang on GPU)."""

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order: ``out[i][j]`` is sample j of prompt i."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named full tensors into the engine's model; returns the number of tensors loaded."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters since creation: tokens generated, seconds spent generating, tokens/s."""
        ...


@runtime_checkable
class TrainingEngine(RolloutEngine, Protocol):
    """A rollout engine that follows a trainer (the HACRL loop's engines): weight sync from the
    trainer, the post-sync check, GPU memory hand-over, shutdown."""

    def sync_from(self, export: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> int:
        """Load ``export()``'s HF-named full tensors (one call per sync; the engine may call
        ``export`` again later to restore a restarted server). Returns the number of tensors."""
        ...

    def sequence_logprob(self, prompt_ids: list[int], response_ids: list[int]) -> float:
        """Σ log π(response | prompt) of the raw model (temperature 1), nats: the weight-sync check."""
        ...

    def release_memory(self) -> None:
        """Give GPU memory back while the trainer trains (engines colocated with it); else nothing."""
        ...

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory back (also done implicitly by the next generate or sync): ``tags``
        ("weights", "kv_cache"; None: all), e.g. the weights alone before a sync whose trainer must
        leave the GPU before the KV cache returns (trainer/colocation.py)."""
        ...

    def close(self) -> None:
        """Stop what the engine started (servers, process groups); idempotent."""
        ...
