"""Paired-by-seed differences with standard errors, from a finished ``tools/compare.py`` folder.

    python benchmarks/paired_by_seed.py OUT [--reference hacpo] [--last 3] [--json OUT.json]
                                        [--include-paired EARLIER.json]

For every agent, every method X other than the reference and three metrics — greedy accuracy at the
final evaluation, the mean of the last ``--last`` greedy evaluations, and pass@k of the final
benchmark evaluation (``<agent>/eval/<bench>/pass@k`` in the run's ``metrics.jsonl``, when
``data.eval_benchmarks`` was set) — prints the reference − X difference over the seeds both ran:
mean ± standard error (sample std / √n) and how many seeds are above / level / below. This is the test
benchmarks/COMPARE_state.md fixes before its runs; tools/compare.py's own tables give mean ± std.

``--include-paired EARLIER.json`` adds the per-seed differences of an earlier ``--json`` output for the
seeds whose run folders OUT lacks (runs made in another session and since removed): a seed is computed
from OUT when both of its run folders are there, else taken from EARLIER; a seed in both must have the
same differences (within 1e-9), else the tool stops naming it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hacrl_megatron.trainer.metrics import read_metrics  # noqa: E402


def run_metrics(out: Path, method: str, seed: int, agent: str, last: int) -> dict[str, float]:
    """final, last-``last`` mean greedy accuracy and final pass@k of one agent in one run (from compare.json
    curves and the run's metrics.jsonl)."""
    data = json.loads((out / "compare.json").read_text())
    run = next(r for r in data["runs"] if r["method"] == method and r["seed"] == seed)
    acc = run["agents"][agent]["accuracy"]
    values = {"final": acc[-1], f"last{last}": statistics.fmean(acc[-last:])}
    rows = read_metrics(out / f"{method}-seed{seed}" / "metrics.jsonl")
    passes = [(row["step"], k, v) for row in rows for k, v in row.items()
              if k.startswith(f"{agent}/eval/") and "/pass@" in k]
    if passes:
        final_step = max(s for s, _, _ in passes)
        for _, key, value in (p for p in passes if p[0] == final_step):
            values[key.split("/", 2)[2].replace("/", " ")] = value
    return values


def summary(seeds: list[int], diffs: list[float]) -> dict[str, Any]:
    """{n, seeds, mean, se, above, level, below, diffs} of per-seed differences (se None for one seed)."""
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
    return {"n": len(diffs), "seeds": seeds, "mean": statistics.fmean(diffs), "se": se,
            "above": sum(d > 0 for d in diffs), "level": sum(d == 0 for d in diffs),
            "below": sum(d < 0 for d in diffs), "diffs": diffs}


def paired(out: Path, reference: str, last: int, earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """agent → method → metric → {n, seeds, mean, se, above, level, below, diffs} of reference − method.

    ``earlier``: a table of this form (an earlier ``--json``) whose seeds fill in where OUT has no run
    folders; see the module docstring."""
    data = json.loads((out / "compare.json").read_text())
    runs = {(r["method"], r["seed"]) for r in data["runs"]}
    earlier = earlier or {}
    agents = sorted({a for r in data["runs"] for a in r["agents"]} | set(earlier))
    methods = sorted(({m for m, _ in runs} | {m for a in earlier.values() for m in a}) - {reference})
    table: dict[str, Any] = {}
    for agent in agents:
        for method in methods:
            theirs = {metric: dict(zip(v["seeds"], v["diffs"]))
                      for metric, v in earlier.get(agent, {}).get(method, {}).items()}
            known = set().union(*theirs.values()) if theirs else set()
            seeds = []
            for seed in sorted(s for m, s in runs if m == method and (reference, s) in runs):
                if (out / f"{reference}-seed{seed}").is_dir() and (out / f"{method}-seed{seed}").is_dir():
                    seeds.append(seed)
                elif seed not in known:
                    raise SystemExit(f"{out}: {reference}/{method} seed {seed} is in compare.json but its run "
                                     "folders are gone and --include-paired does not hold it")
            per_seed = [(run_metrics(out, reference, s, agent, last), run_metrics(out, method, s, agent, last))
                        for s in seeds]
            ours = {metric: {s: a[metric] - b[metric] for s, (a, b) in zip(seeds, per_seed)}
                    for metric in (set.intersection(*(set(a) & set(b) for a, b in per_seed)) if per_seed else ())}
            # every seed must have every reported metric (as without --include-paired): common metrics only
            metrics = set(ours) & set(theirs) if ours and theirs else set(ours) | set(theirs)
            for metric in sorted(metrics):
                merged = dict(theirs.get(metric, {}))
                for seed, diff in ours.get(metric, {}).items():
                    if seed in merged and abs(merged[seed] - diff) > 1e-9:
                        raise SystemExit(f"--include-paired: {agent} {method} {metric} seed {seed}: "
                                         f"{merged[seed]:+.6f} there, {diff:+.6f} from {out}")
                    merged[seed] = diff
                order = sorted(merged)
                table.setdefault(agent, {}).setdefault(method, {})[metric] = summary(order, [merged[s] for s in order])
    return table


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="a tools/compare.py output folder (compare.json and the run folders)")
    p.add_argument("--reference", default="hacpo")
    p.add_argument("--last", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--include-paired", type=Path, default=None, metavar="EARLIER_JSON",
                   help="an earlier --json output whose seeds fill in where OUT has no run folders")
    args = p.parse_args(argv)
    if not (args.out / "compare.json").is_file():
        raise SystemExit(f"{args.out / 'compare.json'}: missing; run tools/compare.py (or --report-only) first")
    earlier = None
    if args.include_paired is not None:
        try:
            earlier = json.loads(args.include_paired.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--include-paired {args.include_paired}: unreadable ({type(exc).__name__}: {exc})") from exc
    table = paired(args.out, args.reference, args.last, earlier)
    print(f"| agent | {args.reference} − method | metric | n | mean ± s.e. | seeds above / level / below |")
    print("|---|---|---|---|---|---|")
    for agent, methods in table.items():
        for method, metrics in methods.items():
            for metric, v in metrics.items():
                se = "n/a" if v["se"] is None else f"{v['se']:.3f}"
                print(f"| {agent} | {method} | {metric} | {v['n']} | {v['mean']:+.3f} ± {se} | "
                      f"{v['above']} / {v['level']} / {v['below']} |")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))
    return table


if __name__ == "__main__":
    main()
