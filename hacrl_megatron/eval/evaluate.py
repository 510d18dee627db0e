"""Benchmark evaluation of one agent: avg@n, pass@k, best@k per benchmark, and result tables.

Each agent is evaluated alone (at inference agents do not collaborate): its prompts are formatted
with its own template (:func:`hacrl_megatron.data.format_prompt`), sampled by its engine, scored by
the shared verifier. The paper's protocol (docs/algorithm.md §9): avg@1 on MATH-500, MATH, GSM8K, AMC23,
Minerva, OlympiadBench and best@30 on AIME2025; the table's "average" is the mean of each
benchmark's primary metric (:data:`PAPER_PRIMARY`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hacrl_megatron.data.prompts import format_prompt
from hacrl_megatron.data.records import PromptRecord
from hacrl_megatron.eval.metrics import problem_metrics
from hacrl_megatron.reward.verify import RewardRequest
from hacrl_megatron.rollout.types import RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)

METRICS = ("avg", "pass_at_k", "best_at_k")
# Primary metric per benchmark in the paper's Table 1; every other benchmark uses "avg".
PAPER_PRIMARY = {"aime2025": "best_at_k"}


@dataclass(frozen=True)
class EvalSettings:
    """How one agent is sampled and scored on every benchmark.

    k: the k of pass@k / best@k; n: samples per problem (None: k; must be ≥ k).
    greedy: argmax decoding (then n must be 1: greedy samples are identical); otherwise sampling
        at ``temperature`` / ``top_p`` with ``seed``.
    max_new_tokens: the response budget; template: prompt template (see ``data.format_prompt``).
    primary: benchmark → primary metric ("avg" | "pass_at_k" | "best_at_k"); None:
        :data:`PAPER_PRIMARY` (best@k for AIME2025, avg elsewhere).
    batch_prompts: prompts per engine call (each gives n sequences).
    """

    k: int = 1
    n: int | None = None
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    template: str = "auto"
    primary: Mapping[str, str] | None = None
    batch_prompts: int = 64
    seed: int | None = 0

    def __post_init__(self) -> None:
        n = self.samples
        if self.k < 1 or n < self.k:
            raise ValueError(f"evaluate: need n >= k >= 1, got k={self.k}, n={n}")
        if self.greedy and n != 1:
            raise ValueError(f"evaluate: greedy decoding gives identical samples; use n=k=1 or greedy=False (got n={n})")
        if self.batch_prompts < 1:
            raise ValueError(f"evaluate: batch_prompts={self.batch_prompts} must be >= 1")
        for bench, metric in self.primary_metrics.items():
            if metric not in METRICS:
                raise ValueError(f"evaluate: primary[{bench!r}]={metric!r} must be one of {list(METRICS)}")

    @property
    def samples(self) -> int:
        """n, the samples per problem."""
        return self.k if self.n is None else self.n

    @property
    def primary_metrics(self) -> dict[str, str]:
        return dict(PAPER_PRIMARY if self.primary is None else self.primary)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(n=self.samples, temperature=0.0 if self.greedy else self.temperature, top_p=self.top_p,
                              max_new_tokens=self.max_new_tokens, seed=self.seed)

    def as_dict(self) -> dict[str, Any]:
        """The settings an :class:`EvalResult` records (and ``results.json`` shows)."""
        return {"k": self.k, "n": self.samples, "greedy": self.greedy, "temperature": self.sampling_params().temperature,
                "top_p": self.top_p, "max_new_tokens": self.max_new_tokens, "template": self.template,
                "seed": self.seed}


@dataclass(frozen=True)
class BenchmarkResult:
    """Scores of one agent on one benchmark.

    Fields: name; num_problems; samples_per_problem (n); k; avg (avg@n); pass_at_k (unbiased);
    best_at_k; primary_metric (one of METRICS, the number the table shows);
    mean_response_tokens (engine tokens, without the ending eos); truncated_fraction (share of
    samples that hit max_new_tokens).
    """

    name: str
    num_problems: int
    samples_per_problem: int
    k: int
    avg: float
    pass_at_k: float
    best_at_k: float
    primary_metric: str = "avg"
    mean_response_tokens: float = 0.0
    truncated_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.primary_metric not in METRICS:
            raise ValueError(f"BenchmarkResult.primary_metric={self.primary_metric!r}: must be one of {list(METRICS)}")

    @property
    def primary(self) -> float:
        return float(getattr(self, self.primary_metric))

    @property
    def label(self) -> str:
        """Column label, e.g. ``math500 (avg@1)`` or ``aime2025 (best@30)``."""
        short = {"avg": f"avg@{self.samples_per_problem}", "pass_at_k": f"pass@{self.k}",
                 "best_at_k": f"best@{self.k}"}[self.primary_metric]
        return f"{self.name} ({short})"


@dataclass(frozen=True)
class EvalResult:
    """One agent's results on several benchmarks.

    Fields: model (row name); benchmarks (name → BenchmarkResult, in evaluation order);
    settings (k, n, greedy, temperature, max_new_tokens, template, seed); samples (name → one dict
    per problem: id, answer, rewards of all samples, first response text) for inspection.
    """

    model: str
    benchmarks: Mapping[str, BenchmarkResult]
    settings: Mapping[str, Any] = field(default_factory=dict)
    samples: Mapping[str, Sequence[Mapping[str, Any]]] = field(default_factory=dict, repr=False)

    @property
    def average(self) -> float:
        """Mean over benchmarks of each one's primary metric (the table's last column)."""
        if not self.benchmarks:
            return math.nan
        return sum(b.primary for b in self.benchmarks.values()) / len(self.benchmarks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "average": self.average,
            "settings": dict(self.settings),
            "benchmarks": {name: {**asdict(b), "primary": b.primary} for name, b in self.benchmarks.items()},
        }


def _score(verifier: Any, requests: list[Any]) -> list[float]:
    """``verifier.score(requests)`` (VerifierPool) or ``verifier(requests)`` (a plain callable)."""
    fn: Callable[[list[Any]], list[float]] = verifier.score if hasattr(verifier, "score") else verifier
    scores = list(fn(requests))
    if len(scores) != len(requests):
        raise ValueError(f"verifier returned {len(scores)} scores for {len(requests)} requests")
    return scores


def _prompt_ids(records: Sequence[PromptRecord], tokenizer: Any, template: str) -> list[list[int]]:
    # add_special_tokens=False: a chat template already wrote every special token into the text.
    return [list(tokenizer(format_prompt(r.question, tokenizer, template), add_special_tokens=False)["input_ids"])
            for r in records]


def _evaluate_benchmark(engine: RolloutEngine, tokenizer: Any, name: str, records: Sequence[PromptRecord],
                        settings: EvalSettings, verifier: Any) -> tuple[BenchmarkResult, list[dict[str, Any]]]:
    if not records:
        raise ValueError(f"evaluate: benchmark {name!r} has no records")
    params = settings.sampling_params()
    prompts = _prompt_ids(records, tokenizer, settings.template)
    completions = []
    for lo in range(0, len(prompts), settings.batch_prompts):
        completions.extend(engine.generate(prompts[lo: lo + settings.batch_prompts], params))
    requests = [RewardRequest(kind=r.kind, response=c.text, reference=r.answer, source=r.source, extra=r.extra)
                for r, group in zip(records, completions, strict=True) for c in group]
    scores = _score(verifier, requests)
    n = params.n
    rewards = [scores[i * n: (i + 1) * n] for i in range(len(records))]
    m = problem_metrics([[s > 0 for s in row] for row in rewards], settings.k)
    flat = [c for group in completions for c in group]
    result = BenchmarkResult(
        name=name, num_problems=len(records), samples_per_problem=n, k=settings.k, avg=m["avg"],
        pass_at_k=m["pass_at_k"], best_at_k=m["best_at_k"],
        primary_metric=settings.primary_metrics.get(name, "avg"),
        mean_response_tokens=sum(len(c.token_ids) for c in flat) / len(flat),
        truncated_fraction=sum(c.finish_reason == "length" for c in flat) / len(flat),
    )
    samples = [{"id": r.id, "answer": r.answer, "rewards": row, "response": group[0].text}
               for r, row, group in zip(records, rewards, completions, strict=True)]
    return result, samples


def evaluate(
    engine: RolloutEngine,
    tokenizer: Any,
    records: Mapping[str, Sequence[PromptRecord]],
    settings: EvalSettings = EvalSettings(),
    *,
    verifier: Any,
    model_name: str = "model",
    log_each: bool = True,
) -> EvalResult:
    """Evaluate one agent on several benchmarks.

    Args:
        engine: the agent's rollout engine; tokenizer: its tokenizer (prompt formatting).
        records: benchmark name → PromptRecords.
        settings: sampling and metric settings (:class:`EvalSettings`).
        verifier: ``VerifierPool`` (anything with ``.score(list[RewardRequest]) -> list[float]``)
            or a callable with that signature.
        model_name: the result's row name.
        log_each: log each benchmark's score as it is done (``hacrl eval``'s progress); the trainer
            prints its evaluations itself, once.
    """
    results: dict[str, BenchmarkResult] = {}
    samples: dict[str, list[dict[str, Any]]] = {}
    for name, recs in records.items():
        results[name], samples[name] = _evaluate_benchmark(engine, tokenizer, name, recs, settings, verifier)
        if log_each:
            logger.info("%s on %s: %s = %.3f", model_name, name, results[name].label, results[name].primary)
    return EvalResult(model=model_name, benchmarks=results, settings=settings.as_dict(), samples=samples)


def markdown_table(results: Sequence[EvalResult]) -> str:
    """Table 1 style: one row per model, one column per benchmark (primary metric), then average."""
    if not results:
        raise ValueError("markdown_table: no results")
    labels: dict[str, str] = {}
    for r in results:
        for name, b in r.benchmarks.items():
            labels.setdefault(name, b.label)
    head = "| model | " + " | ".join(labels.values()) + " | average |"
    sep = "|---|" + "---|" * (len(labels) + 1)
    rows = []
    for r in results:
        cells = [f"{r.benchmarks[n].primary:.3f}" if n in r.benchmarks else "–" for n in labels]
        rows.append(f"| {r.model} | " + " | ".join(cells) + f" | {r.average:.3f} |")
    return "\n".join([head, sep, *rows]) + "\n"


def write_results(results: EvalResult | Sequence[EvalResult], out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.json`` (metrics), ``results.md`` (the table) and ``samples.jsonl`` (per problem).

    Returns the paths by kind ("json", "markdown", "samples").
    """
    items = [results] if isinstance(results, EvalResult) else list(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md", "samples": out / "samples.jsonl"}
    paths["json"].write_text(json.dumps({"results": [r.to_dict() for r in items]}, indent=2))
    paths["markdown"].write_text(markdown_table(items))
    with paths["samples"].open("w") as f:
        for r in items:
            for bench, rows in r.samples.items():
                for row in rows:
                    f.write(json.dumps({"model": r.model, "benchmark": bench, **row}) + "\n")
    return paths
