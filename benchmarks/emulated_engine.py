"""A rollout engine that spends wall time, not CPU: generation sleeps ``tokens / tokens_per_s``.

For measuring the loop's schedule on a 2-core machine (stages overlapping across agents, rollout
overlapping training) without the rollout competing with the trainer for the cores, as a GPU
server on other devices would not. Responses are random token ids of the agent's tokenizer (drawn
from each sample's seed, so a resumed or repeated run samples the same); scoring, weight loads,
memory hand-over and counters go to the real engine it wraps, so weight sync and the post-sync check
run for real. ``runs_in_process = False``: it only sleeps, so agents may generate at the same time.
"""

from __future__ import annotations

import random
import time
from typing import Any

from hacrl_megatron.rollout.types import Completion, SamplingParams


class EmulatedEngine:
    """Wraps ``inner`` (an HF engine with a tokenizer); ``generate`` sleeps instead of computing.

    tokens_per_s: emulated generation rate over all sequences of a call.
    finish_eos_every: every k-th sample ends with the eos (the others hit max_new_tokens); 0: none.
    """

    runs_in_process = False

    def __init__(self, inner: Any, tokens_per_s: float, *, finish_eos_every: int = 3) -> None:
        if tokens_per_s <= 0:
            raise ValueError(f"EmulatedEngine: tokens_per_s={tokens_per_s} must be > 0")
        self.inner = inner
        self.tokens_per_s = float(tokens_per_s)
        self.finish_eos_every = finish_eos_every
        tok = inner.tokenizer
        special = set(getattr(tok, "all_special_ids", []) or [])
        self._ids = [i for i in range(len(tok)) if i not in special]
        self.generated_tokens = 0
        self.sleep_s = 0.0

    def __getattr__(self, name: str) -> Any:  # everything but generation is the real engine's
        return getattr(self.inner, name)

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        out, tokens = [], 0
        for i, _ in enumerate(prompt_token_ids):
            group = []
            for j in range(params.n):
                rng = random.Random(((params.seed or 0) * 1_000_003 + i * 7919 + j) % (2**31 - 1))
                ids = tuple(rng.choice(self._ids) for _ in range(params.max_new_tokens))
                eos = self.finish_eos_every and (i * params.n + j) % self.finish_eos_every == 0
                if eos:
                    ids = ids[: max(1, len(ids) // 2)]
                tokens += len(ids)
                text = self.inner.tokenizer.decode(list(ids), skip_special_tokens=True)
                group.append(Completion(token_ids=ids, text=text, finish_reason="eos" if eos else "length"))
            out.append(group)
        wait = tokens / self.tokens_per_s
        time.sleep(wait)
        self.generated_tokens += tokens
        self.sleep_s += wait
        return out
