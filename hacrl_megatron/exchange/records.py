"""Tokenizer-neutral trajectory records and a learner's tokenized view of one (docs/algorithm.md §3, §6).

A :class:`Trajectory` is what crosses from one agent to the others: text plus the source's own
ids, the shared reward, and the source's log-prob sum under π_old with its token count (the
``(1/L_j)·Σ log π^(j)_old`` half of eq. 11). A :class:`LearnerView` is that trajectory as one
learner k trains on it: its prompt and the response re-encoded with k's tokenizer (the
``(1/L_k)·Σ log π^(k)_θ`` half).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

FINISH_REASONS = ("eos", "length")


@dataclass(frozen=True)
class Trajectory:
    """One sampled response, as every agent sees it.

    Fields:
        prompt_id: id of the :class:`~hacrl_megatron.data.records.PromptRecord` it answers.
        source: name of the agent that sampled it (j in docs/algorithm.md).
        prompt_text: the raw question (each learner re-formats it with its own template, §6).
        response_text: the response decoded by the source (special tokens skipped).
        token_ids: the source tokenizer's response ids, **without** the eos that ended it
            (the :class:`~hacrl_megatron.rollout.Completion` convention).
        finish_reason: "eos" — the source chose to stop (its eos or a stop token/string);
            "length" — cut at the token budget.
        reward: the shared verifier's score R(y) ∈ [0, 1], computed once.
        source_len: L_j, the number of source tokens ``source_logp_sum`` covers: the source's own
            trained view, i.e. ``len(token_ids) + 1`` when finish_reason == "eos" (its eos is
            trained) else ``len(token_ids)``; see :meth:`from_completion`.
        source_logp_sum: Σ_t log π^(j)_old(y_t | x, y_<t) at the rollout temperature (nats),
            computed by the source's trainer before any update of the step; NaN until then
            (fill it with :meth:`with_logp`).
        policy_version: the source's optimizer-step count when it sampled (staleness checks).
        remote_tokens: None for a trajectory sampled in this process. For one received from a peer
            job through the exchange (exchange/remote): the author's response token count without
            its eos, while ``token_ids`` stays empty — ids never cross between jobs, every learner
            re-encodes ``response_text`` (the author's decoding, special tokens skipped).
    """

    prompt_id: str
    source: str
    prompt_text: str
    response_text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    reward: float
    source_len: int
    policy_version: int = 0
    source_logp_sum: float = field(default=math.nan)
    remote_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Trajectory.finish_reason={self.finish_reason!r}: must be one of {list(FINISH_REASONS)}"
            )
        if not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if self.remote_tokens is not None and (self.token_ids or self.remote_tokens < 0):
            raise ValueError(f"Trajectory.remote_tokens={self.remote_tokens!r}: a peer's trajectory has no token_ids "
                             "and a count >= 0")
        expected = self.num_tokens + (1 if self.finish_reason == "eos" else 0)
        if self.source_len < 0 or self.source_len > expected:
            raise ValueError(
                f"Trajectory.source_len={self.source_len}: must lie in [0, {expected}] "
                f"(len(token_ids)={len(self.token_ids)}, finish_reason={self.finish_reason!r})"
            )
        if not math.isfinite(self.reward):
            raise ValueError(f"Trajectory.reward={self.reward!r}: must be finite")

    @property
    def num_tokens(self) -> int:
        """The source's response token count, without the eos that ended it."""
        return len(self.token_ids) if self.remote_tokens is None else self.remote_tokens

    @property
    def is_remote(self) -> bool:
        """Received from a peer job: text only, no source token ids."""
        return self.remote_tokens is not None

    @classmethod
    def from_completion(
        cls,
        completion: Any,
        *,
        prompt_id: str,
        source: str,
        prompt_text: str,
        reward: float,
        policy_version: int = 0,
        max_response_len: int | None = None,
    ) -> Trajectory:
        """Build from a :class:`~hacrl_megatron.rollout.Completion`.

        A "stop" finish (stop token or string) counts as "eos": the agent ended the answer on
        purpose, so every learner's view appends its own eos. ``source_len`` follows the source's
        self view: response ids (right-truncated to ``max_response_len``) plus eos unless truncated.
        """
        ids = tuple(completion.token_ids)
        finish = "length" if completion.finish_reason == "length" else "eos"
        # The source's self view is response ids (+ eos), right-truncated to max_response_len.
        source_len = len(ids) + (1 if finish == "eos" else 0)
        if max_response_len is not None:
            source_len = min(source_len, max_response_len)
        return cls(
            prompt_id=prompt_id,
            source=source,
            prompt_text=prompt_text,
            response_text=completion.text,
            token_ids=ids,
            finish_reason=finish,
            reward=float(reward),
            source_len=source_len,
            policy_version=policy_version,
        )

    def with_logp(self, logp_sum: float, source_len: int | None = None) -> Trajectory:
        """Copy with ``source_logp_sum`` (and optionally ``source_len``) filled in."""
        if not math.isfinite(logp_sum):
            raise ValueError(f"Trajectory.with_logp: logp_sum={logp_sum!r} must be finite")
        return replace(self, source_logp_sum=float(logp_sum),
                       source_len=self.source_len if source_len is None else int(source_len))


@dataclass(frozen=True)
class LearnerView:
    """A trajectory tokenized for one learner (docs/algorithm.md §6). All sequences are tuples of ints.

    Fields:
        input_ids: learner prompt ids followed by learner response ids; length prompt_len + response_len.
        prompt_len: number of prompt tokens (after left truncation to max_prompt_len).
        response_len: L_k, number of response tokens trained on, including an appended eos.
        response_mask: 0 for each prompt position, 1 for each response position (same length as
            input_ids); the log-prob at position t predicts input_ids[t] from input_ids[:t].
        truncated_prompt: the learner prompt was longer than max_prompt_len and lost its left end.
        truncated_response: the response was longer than max_response_len and lost its right end
            (then no eos is appended: the learner must not learn to stop mid-answer).
        eos_appended: the learner's eos id is the last response token.
    """

    input_ids: tuple[int, ...]
    prompt_len: int
    response_len: int
    response_mask: tuple[int, ...]
    truncated_prompt: bool = False
    truncated_response: bool = False
    eos_appended: bool = False

    def __post_init__(self) -> None:
        if len(self.input_ids) != self.prompt_len + self.response_len:
            raise ValueError(
                f"LearnerView: len(input_ids)={len(self.input_ids)} != prompt_len {self.prompt_len}"
                f" + response_len {self.response_len}"
            )
        if len(self.response_mask) != len(self.input_ids):
            raise ValueError(
                f"LearnerView: len(response_mask)={len(self.response_mask)} != len(input_ids)={len(self.input_ids)}"
            )

    @property
    def response_ids(self) -> tuple[int, ...]:
        return self.input_ids[self.prompt_len:]

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.input_ids[: self.prompt_len]
