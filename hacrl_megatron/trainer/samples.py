"""The generations of a training step, on disk: ``<output_dir>/samples/step-000010.jsonl``.

Written on the first step, every ``log.samples_every`` steps and on the last step, for the step's first
``log.samples_prompts`` prompts, one JSON object per prompt::

    {"step": 10, "index": 0, "id": "addition-...", "question": "12+34=", "reference": "46",
     "agents": {"llama": [{"text": "...", "text_cut": false, "reward": 1.0, "length": 7, "finish_reason": "eos",
                           "advantage": {"llama": 0.71, "qwen3": 0.52},
                           "cross": {"qwen3": {"ratio": 0.93, "clipped": false}}}, ...],
                "qwen3": [...]}}

Per agent (the source j), its G completions in sampling order: the text (cut at
``log.samples_max_chars`` characters, ``text_cut`` says so), the shared reward, the length in the
source's tokens (without the eos that ended it), the finish reason, the advantage each learner k that
trains on it gives it (eq. 6-7: A^(k), with k's capability weights), and for each *other* learner k the
cross ratio s^(k,j) = exp((Σ log π^(k)_old)/L_k − (Σ log π^(j)_old)/L_j) (eq. 11) before the step's first
update, and whether the cross window of that update leaves it without gradient (eq. 14 with the
adaptive centre of §5b where used; null for methods without a cross window, docs/algorithm.md §8).
A view with no response token (trained on by nobody) has ratio null.

The size is bounded by the three keys: prompts × agents × G completions of at most max_chars each.
The ratios cost one forward pass of each learner over the other agents' completions of those prompts
only. ``hacrl samples RUN --step N`` prints a file readably.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from hacrl_megatron.algo import Algorithm
from hacrl_megatron.algo.hacpo import sequence_log_ratio
from hacrl_megatron.config import ExperimentConfig
from hacrl_megatron.exchange.records import Trajectory
from hacrl_megatron.exchange.retokenize import Exchange
from hacrl_megatron.trainer.stages import StepData, prompt_id_map, views_to_batch

SAMPLES_DIR = "samples"


def samples_path(output_dir: str | Path, step: int) -> Path:
    """``<output_dir>/samples/step-<step, 6 digits>.jsonl``."""
    return Path(output_dir) / SAMPLES_DIR / f"step-{step:06d}.jsonl"


def writes_samples(exp: ExperimentConfig, step: int) -> bool:
    """Whether step ``step`` (1-based, as in metrics.jsonl) writes its samples: the first, every
    ``log.samples_every`` and the last; never when ``log.samples_every`` is 0."""
    every = exp.log.samples_every
    return bool(every) and (step == 1 or step % every == 0 or step == exp.train.steps)


def _learner_log_ratios(rt: Any, trajs: list[Trajectory], data: StepData, exchange: Exchange, exp: ExperimentConfig,
                        prompts: int) -> list[float | None]:
    """log s^(k,j) of learner ``rt`` on ``trajs`` (another agent's completions of the first ``prompts``
    prompts), from one forward pass at the rollout temperature; None for a view without response tokens."""
    views = exchange.views(rt.name, trajs, prompt_id_map(rt, data.prompts[:prompts]), record_stats=False)
    keep = [i for i, (v, t) in enumerate(zip(views, trajs)) if v.response_len > 0 and t.source_len > 0]
    out: list[float | None] = [None] * len(trajs)
    if not keep:
        return out
    sums, lens = rt.trainer.sequence_logprobs(views_to_batch([views[i] for i in keep]), exp.rollout.temperature)
    log_s = sequence_log_ratio(torch.as_tensor(sums, dtype=torch.float64), torch.as_tensor(lens),
                               torch.tensor([trajs[i].source_logp_sum for i in keep], dtype=torch.float64),
                               torch.tensor([trajs[i].source_len for i in keep]), exp.hacpo.max_abs_log_ratio)
    for i, value in zip(keep, log_s.tolist()):
        out[i] = value
    return out


def _clipped(log_s: float | None, advantage: float, center: float, algorithm: Algorithm) -> bool | None:
    """Whether the first update's cross window leaves this sample without gradient (as cross_clipfrac counts
    it); None without a cross window or without a ratio."""
    return None if log_s is None else algorithm.cross_clipped(log_s, advantage, center)


def sample_rows(runtimes: list[Any], data: StepData, exchange: Exchange, algorithm: Algorithm, omega: torch.Tensor,
                centers: torch.Tensor | None, exp: ExperimentConfig, step: int,
                learners: list[int] | None = None) -> list[dict[str, Any]]:
    """The rows of ``samples/step-<step>.jsonl`` (see the module) from a step's data after
    :func:`~hacrl_megatron.trainer.stages.old_logprobs`, with the step's ω ([n, n]) and adaptive
    centres ([n, n] or None). ``runtimes``: every agent in config order; ``learners``: the indices whose
    trainers run here (default: all; a job of ``hacrl train --agent`` has its own only), whose advantages
    and cross ratios the rows show. Agents without responses in ``data`` (a peer left out) are skipped."""
    names = [rt.name for rt in runtimes]
    prompts = min(exp.log.samples_prompts, len(data.prompts))
    g = data.rewards.shape[2]
    cut = exp.log.samples_max_chars
    learners = list(range(len(runtimes))) if learners is None else learners
    advantages = {k: algorithm.advantages(data.rewards, k, omega) for k in learners}  # [P, sources, G]
    sources = {k: algorithm.sources(k) for k in learners}
    log_s = {(k, j): _learner_log_ratios(runtimes[k], data.trajectories[names[j]][:prompts * g], data, exchange,
                                         exp, prompts)
             for k in learners for j in sources[k] if j != k and names[j] in data.trajectories}
    rows = []
    for p, record in enumerate(data.prompts[:prompts]):
        agents: dict[str, list[dict[str, Any]]] = {}
        for j, name in enumerate(names):
            if name not in data.trajectories:
                continue
            completions = []
            for i in range(g):
                t = data.trajectories[name][p * g + i]
                adv = {names[k]: float(advantages[k][p, sources[k].index(j), i]) for k in sources if j in sources[k]}
                entry = {"text": t.response_text[:cut], "text_cut": len(t.response_text) > cut,
                         "reward": float(data.rewards[p, j, i]), "length": t.num_tokens,
                         "finish_reason": t.finish_reason, "advantage": adv}
                cross = {}
                for (k, src), values in log_s.items():
                    if src == j:
                        value = values[p * g + i]
                        center = 0.0 if centers is None else float(centers[k, j])
                        cross[names[k]] = {"ratio": None if value is None else math.exp(value),
                                           "clipped": _clipped(value, adv[names[k]], center, algorithm)}
                if cross:
                    entry["cross"] = cross
                completions.append(entry)
            agents[name] = completions
        rows.append({"step": step, "index": p, "id": record.id, "question": record.question,
                     "reference": record.answer, "agents": agents})
    return rows


def write_samples(output_dir: str | Path, step: int, rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` to :func:`samples_path` whole or not at all (a temporary file renamed over it: a
    resumed run that repeats the step replaces it)."""
    path = samples_path(output_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
