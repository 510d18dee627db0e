"""eval stage: one agent alone on benchmarks — avg@n, unbiased pass@k, best@k; Table-1 style output.

``run_eval(agent, EvalData(benchmarks, paths), EvalSettings(k=...))`` loads, evaluates and writes;
``evaluate`` works on a ready engine and records; ``write_results`` writes ``results.json``, ``results.md`` and
``samples.jsonl``. Metric definitions: :mod:`hacrl_megatron.eval.metrics`.
"""

from hacrl_megatron.eval.evaluate import (
    METRICS,
    PAPER_PRIMARY,
    BenchmarkResult,
    EvalResult,
    EvalSettings,
    evaluate,
    markdown_table,
    write_results,
)
from hacrl_megatron.eval.metrics import pass_at_k, problem_metrics
from hacrl_megatron.eval.run import EvalData, load_eval_records, load_hf_agent, run_eval

__all__ = [
    "METRICS",
    "PAPER_PRIMARY",
    "BenchmarkResult",
    "EvalData",
    "EvalResult",
    "EvalSettings",
    "evaluate",
    "load_eval_records",
    "load_hf_agent",
    "markdown_table",
    "pass_at_k",
    "problem_metrics",
    "run_eval",
    "write_results",
]
