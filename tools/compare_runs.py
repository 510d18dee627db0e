"""The run folders of tools/compare.py on disk: whether a run finished, and whether a folder holds it.

A run folder ``OUT/<method>-seed<seed>/`` records its config in ``config.json`` when the run is
claimed; a folder recording a different config is refused, so two comparisons cannot mix their runs.
A run is finished when ``done.json`` exists and ``metrics.jsonl`` reaches the final step.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Protocol

from hacrl_megatron.config import ConfigError, ExperimentConfig
from hacrl_megatron.config.loading import from_dict
from tools.compare_report import CompareError


class PlannedRun(Protocol):
    """What these functions read of a planned run (tools/compare.py ``RunSpec``)."""

    name: str
    out_dir: Path
    exp: ExperimentConfig


def last_step(metrics_path: Path) -> int | None:
    """The last step ``metrics.jsonl`` records; None if the file is missing or empty."""
    from hacrl_megatron.trainer.metrics import read_metrics

    if not metrics_path.exists():
        return None
    rows = read_metrics(metrics_path)
    return int(rows[-1]["step"]) if rows else None


def is_done(spec: PlannedRun) -> bool:
    """Finished: ``done.json`` written and ``metrics.jsonl`` reaches the final step."""
    return (spec.out_dir / "done.json").exists() and last_step(spec.out_dir / "metrics.jsonl") == spec.exp.train.steps


def check_same_run(spec: PlannedRun) -> bool:
    """Whether the run's folder already records its config; raises if it records a different run (every
    section but ``output_dir``: a folder moved or linked under another ``--out`` holds the same run)."""
    path = spec.out_dir / "config.json"
    if not path.exists():
        return False
    config = json.loads(json.dumps(spec.exp.to_dict()))
    try:
        old = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CompareError(f"{path}: not readable JSON ({exc}); delete that folder to rerun the run") from exc
    if old != config:
        # a config written by an earlier version lacks keys added since with their defaults: compare
        # it as the current schema reads it
        with contextlib.suppress(ConfigError, TypeError, ValueError):
            old = json.loads(json.dumps(from_dict(ExperimentConfig, old).to_dict()))
    # a run folder moved, copied or linked under another --out is the same run: its output_dir differs only
    old.pop("output_dir", None)
    config.pop("output_dir", None)
    if old != config:
        diff = sorted(k for k in set(old) | set(config) if old.get(k) != config.get(k))
        raise CompareError(f"{path}: holds a run with a different config (sections {diff}); "
                           "use another --out or delete that folder")
    return True


def claim_dir(spec: PlannedRun) -> None:
    """Record the run's config in ``config.json``; refuse a folder that holds a different run."""
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    if not check_same_run(spec):
        (spec.out_dir / "config.json").write_text(json.dumps(spec.exp.to_dict(), indent=1))


def finished_runs(specs: list) -> list:
    """The planned runs that are done and recorded as these runs; prints the others by name."""
    done = [s for s in specs if is_done(s) and check_same_run(s)]
    for spec in specs:
        if spec not in done:
            print(f"[compare] {spec.name}: not finished in {spec.out_dir}, left out of the report", flush=True)
    if not done:
        raise CompareError(f"--report-only: no finished run under {specs[0].out_dir.parent} for these "
                           "--methods/--seeds/--set")
    return done
