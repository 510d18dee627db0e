"""Per-family training statistics of finished runs on a task with problem families (docs/algorithm.md §10b).

    python benchmarks/family_metrics.py RUN [RUN ...] [--json OUT.json]

For each run folder (its ``metrics.jsonl``), each learner, each source and each family: the mean over the
run's training steps of ``<agent>/hacpo/family/<family>/...`` (the cross clip fractions by sign of A and
side of the window, the median log s, ``cross_grad_share``, ``self_clipfrac``) and of
``<agent>/reward/<family>/mean``, as one markdown table per run; a step that did not log a key (no
sequence of that family, source or sign in it) is left out of that key's mean, and the table says over how
many steps each cell is. Prints the tables; ``--json`` writes {run: {key: {"mean", "first5", "last5",
"steps"}}} (first5 / last5: the means over the first and the last five steps that logged the key).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hacrl_megatron.trainer.metrics import read_metrics  # noqa: E402

FAMILY_KEY = re.compile(r"^(?P<agent>[^/]+)/(?:hacpo/family/(?P<family>[^/]+)/(?P<stat>.+)"
                        r"|reward/(?P<rfamily>[^/]+)/mean)$")
COLUMNS = (("reward", "reward/mean"), ("clipped A>0", "cross_clipfrac/{s}/pos"),
           ("above", "cross_clipfrac/{s}/pos/above"), ("below", "cross_clipfrac/{s}/pos/below"),
           ("clipped A<0", "cross_clipfrac/{s}/neg"), ("above", "cross_clipfrac/{s}/neg/above"),
           ("below", "cross_clipfrac/{s}/neg/below"), ("median log s", "cross_log_ratio_median/{s}"),
           ("cross_grad_share", "cross_grad_share"), ("self_clipfrac", "self_clipfrac"))


def family_statistics(run: Path) -> dict[str, dict[str, float]]:
    """{key: {"mean", "first5", "last5", "steps"}} over the training steps of ``run/metrics.jsonl`` (rows that
    hold a loss; step 0's evaluation row holds none)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"family_metrics: {path} does not exist (a run folder of hacrl train or tools/compare.py)")
    steps = [row for row in read_metrics(path) if any(k.endswith("/hacpo/loss") for k in row)]
    out: dict[str, dict[str, float]] = {}
    for key in sorted({k for row in steps for k in row if FAMILY_KEY.match(k)}):
        values = [float(row[key]) for row in steps if key in row]
        out[key] = {"mean": sum(values) / len(values), "first5": sum(values[:5]) / len(values[:5]),
                    "last5": sum(values[-5:]) / len(values[-5:]), "steps": len(values)}
    if not out:
        raise SystemExit(f"family_metrics: {path} logs no per-family metric (a task with problem families, e.g. "
                         "data.task=add_sub_cot, and a trainer that logs them)")
    return out


def table(stats: dict[str, dict[str, float]]) -> str:
    """One row per (learner ← source, family): the columns of :data:`COLUMNS`, mean over steps (n/a: never
    logged)."""
    rows: dict[tuple[str, str], None] = {}
    for key in stats:
        m = FAMILY_KEY.match(key)
        if m and m["family"]:
            rows.setdefault((m["agent"], m["family"]), None)
    sources: dict[str, set[str]] = {}
    for key in stats:
        m = re.match(r"^([^/]+)/hacpo/family/[^/]+/cross_log_ratio_median/([^/]+)$", key)
        if m:
            sources.setdefault(m[1], set()).add(m[2])
    lines = ["| learner ← source | family | " + " | ".join(c for c, _ in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for agent, family in rows:
        for source in sorted(sources.get(agent, {"-"})):
            cells = []
            for _, stat in COLUMNS:
                key = (f"{agent}/reward/{family}/mean" if stat == "reward/mean"
                       else f"{agent}/hacpo/family/{family}/{stat.format(s=source)}")
                cells.append(f"{stats[key]['mean']:.3f}" if key in stats else "n/a")
            lines.append(f"| {agent} ← {source} | {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders (each with metrics.jsonl)")
    p.add_argument("--json", type=Path, help="write the statistics of every run here")
    args = p.parse_args(argv)
    result: dict[str, Any] = {}
    for run in args.runs:
        stats = family_statistics(run)
        result[str(run)] = stats
        print(f"### {run}\n\n{table(stats)}\n")
    if args.json:
        try:
            args.json.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        except OSError as err:
            raise SystemExit(f"family_metrics: cannot write --json {args.json}: {err.strerror}") from err
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
