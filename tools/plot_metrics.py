"""Learning curves from the ``metrics.jsonl`` of one or more runs, drawn to a PNG.

    python tools/plot_metrics.py RUN_DIR [RUN_DIR ...] --out curves.png [--keys reward_mean eval_accuracy ...]

A RUN_DIR is a run's output folder (or the ``metrics.jsonl`` file itself). Keys are per-agent
metric names without the agent prefix (``llama/hacpo/cross_clipfrac`` is key
``hacpo/cross_clipfrac`` of agent ``llama``) or run-wide names such as ``time/train_s``. One subplot
per key, one line per (run, agent), x = RL step. Default keys: reward_mean (mean verifier reward of
the agent's own rollouts), eval_accuracy (greedy held-out accuracy), hacpo/cross_clipfrac (share of
cross samples with nonzero advantage outside the cross window, docs/algorithm.md §5) and capability (P̂, docs/algorithm.md §1),
then one panel per benchmark the runs evaluated on (``eval/<benchmark>/avg@k``, from ``data.eval_benchmarks``);
a default key that no run logged is left out, an asked-for one is an error.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python tools/plot_metrics.py` from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from hacrl_megatron.trainer.metrics import read_metrics_lines  # noqa: E402

DEFAULT_KEYS = ("reward_mean", "eval_accuracy", "hacpo/cross_clipfrac", "capability")
TITLES = {
    "reward_mean": "mean reward of own rollouts",
    "eval_accuracy": "greedy eval accuracy",
    "hacpo/cross_clipfrac": "cross-sample clip fraction (docs/algorithm.md §5)",
    "capability": "capability P̂ (docs/algorithm.md §1)",
}


class PlotError(ValueError):
    """Bad input to the plotter; the message names the file or key."""


def metrics_path(run: str | Path) -> Path:
    """``RUN_DIR/metrics.jsonl`` (or ``run`` itself when it is a file); raises PlotError when missing."""
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        what = "no metrics.jsonl in this run folder" if Path(run).is_dir() else "no such run folder or metrics file"
        raise PlotError(f"{path}: {what}")
    return path


def load_runs(runs: list[str | Path]) -> dict[str, list[dict[str, float]]]:
    """Run label → metric rows sorted by step. Labels are folder names, or full paths when those collide.

    A line that is not a metrics row (torn by a killed run) is reported on stderr with its line number
    and skipped.
    """
    paths = [metrics_path(r) for r in runs]
    names = [p.parent.name or str(p.parent) for p in paths]
    if len(set(names)) < len(names):
        names = [str(p.parent) for p in paths]
    out = {}
    for name, path in zip(names, paths):
        rows, skipped = read_metrics_lines(path)
        for number, why in skipped:  # a run killed mid-write leaves a torn line: report it, plot the rest
            print(f"warning: {path} line {number}: {why}, skipped", file=sys.stderr)
        if not rows:
            raise PlotError(f"{path}: holds no metric rows")
        out[name] = rows
    return out


def agent_names(rows: list[dict[str, float]]) -> list[str]:
    """Agents of a run, in first-seen order: every ``<agent>/reward_mean`` or ``<agent>/eval_accuracy`` key."""
    names: list[str] = []
    for row in rows:
        for key in row:
            agent, _, rest = key.partition("/")
            if rest in ("reward_mean", "eval_accuracy") and agent not in names:
                names.append(agent)
    return names


def series(rows: list[dict[str, float]], column: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that logged ``column`` (evaluation keys appear every eval_every steps)."""
    pts = [(int(r["step"]), float(r[column])) for r in rows if column in r and math.isfinite(float(r[column]))]
    return [s for s, _ in pts], [v for _, v in pts]


def lines_for(runs: dict[str, list[dict]], key: str) -> list[tuple[int, str, list[int], list[float]]]:
    """Every (run index, label, steps, values) line of ``key``: per agent where the agent-prefixed
    column exists, else one run-wide line."""
    lines = []
    for i, (run, rows) in enumerate(runs.items()):
        per_agent = [(i, f"{run}: {a}", *series(rows, f"{a}/{key}")) for a in agent_names(rows)]
        per_agent = [line for line in per_agent if line[2]]
        if per_agent:
            lines.extend(per_agent)
        else:
            steps, values = series(rows, key)
            if steps:
                lines.append((i, run, steps, values))
    return lines


def available_keys(runs: dict[str, list[dict]]) -> list[str]:
    """Every plottable key (agent prefix removed), for error messages."""
    keys = set()
    for rows in runs.values():
        agents = set(agent_names(rows))
        for row in rows:
            for col in row:
                head, _, rest = col.partition("/")
                if col not in ("step", "time"):
                    keys.add(rest if head in agents else col)
    return sorted(keys)


def benchmark_keys(runs: dict[str, list[dict]]) -> list[str]:
    """The ``eval/<benchmark>/avg@k`` keys any run logged (``data.eval_benchmarks``), in first-seen order."""
    keys: list[str] = []
    for key in available_keys(runs):
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[2].startswith("avg@") and key not in keys:
            keys.append(key)
    return keys


def default_keys(runs: dict[str, list[dict]]) -> list[str]:
    """:data:`DEFAULT_KEYS`, then every benchmark's avg@k panel."""
    return list(DEFAULT_KEYS) + benchmark_keys(runs)


def plot(runs: dict[str, list[dict]], keys: list[str], out: Path, strict: bool = True) -> list[str]:
    """Draw one subplot per key to ``out`` (PNG); returns the keys drawn.

    ``strict``: a key no run logged raises PlotError naming it; otherwise it is skipped.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    styles = ("-", "--", ":", "-.")  # one line style per run, colours per line
    panels = []
    for key in keys:
        lines = lines_for(runs, key)
        if lines:
            panels.append((key, lines))
        elif strict:
            raise PlotError(f"unknown key {key!r}: no run logged it; available: {available_keys(runs)}")
    if not panels:
        raise PlotError(f"none of the keys {keys} was logged; available: {available_keys(runs)}")
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 3.8 * nrows), squeeze=False)
    for ax, (key, lines) in zip(axes.flat, panels):
        for run_index, label, steps, values in lines:
            sparse = len(steps) < 0.5 * (max(steps) - min(steps) + 1)  # e.g. eval every 10 steps
            ax.plot(steps, values, label=label, ls=styles[run_index % len(styles)],
                    marker="o" if sparse or len(steps) == 1 else None, ms=3, lw=1.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(TITLES.get(key, key))
        ax.set_xlabel("RL step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [k for k, _ in panels]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run output folders (or metrics.jsonl files)")
    p.add_argument("--out", type=Path, required=True, help="PNG file to write")
    p.add_argument("--keys", nargs="+", default=None,
                   help=f"metric keys without agent prefix (default: {' '.join(DEFAULT_KEYS)}, and "
                        "eval/<benchmark>/avg@k of every benchmark evaluated)")
    args = p.parse_args(argv)
    try:
        runs = load_runs(args.runs)
        drawn = plot(runs, args.keys or default_keys(runs), args.out, strict=args.keys is not None)
    except PlotError as err:
        p.error(str(err))
    print(f"wrote {args.out}: {', '.join(drawn)} for {len(runs)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
