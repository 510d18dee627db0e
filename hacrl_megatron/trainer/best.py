"""``checkpoint.export_best``: each agent's weights at its best evaluation, next to the last ones.

After every evaluation, each agent's score is its greedy accuracy on the held-out set
(``<agent>/eval_accuracy``, when ``data.eval_size`` > 0), else the mean of its avg@k over the
benchmarks of ``data.eval_benchmarks``. When it beats the agent's best so far (strictly: a tie keeps
the earlier, shorter-trained weights), the agent is exported as a standalone HF folder to
``<output_dir>/best/<agent>/`` (replaced atomically), with ``hacrl_best.json`` beside the weights:
``{"step": 40, "score": 0.79, "metric": "eval_accuracy"}``. Step 0 is the evaluation before training.
The best scores so far are kept in the checkpoints, so a resumed run goes on comparing with them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BEST_DIR = "best"
BEST_FILE = "hacrl_best.json"


def agent_score(metrics: dict[str, float], agent: str) -> tuple[float, str] | None:
    """(score, metric name) of ``agent`` in one evaluation's ``metrics``; None when it was not evaluated."""
    if f"{agent}/eval_accuracy" in metrics:
        return metrics[f"{agent}/eval_accuracy"], "eval_accuracy"
    prefix = f"{agent}/eval/"
    values = {k: v for k, v in metrics.items() if k.startswith(prefix) and "/avg@" in k}
    if not values:
        return None
    names = sorted(k[len(prefix):] for k in values)
    return sum(values.values()) / len(values), "mean of " + ", ".join(names)


def update_best(best: dict[str, list[Any]], metrics: dict[str, float], step: int, runtimes: list[Any],
                output_dir: str | Path, export: Any) -> list[str]:
    """Export every agent whose score in ``metrics`` beats ``best[agent] = [score, step]`` (updated in place)
    with ``export(runtime, folder)``; returns one line per export."""
    lines = []
    for rt in runtimes:
        found = agent_score(metrics, rt.name)
        if found is None or (rt.name in best and found[0] <= best[rt.name][0]):
            continue
        score, metric = found
        folder = Path(output_dir) / BEST_DIR / rt.name
        export(rt, folder)
        (folder / BEST_FILE).write_text(json.dumps({"step": step, "score": score, "metric": metric}) + "\n")
        best[rt.name] = [score, step]
        lines.append(f"{rt.name}: best so far (step {step}, {metric} {score:.3f}) → {folder}")
    return lines
