"""The results side of tools/compare.py: run records, summaries over seeds, paired differences, tables, plot.

Runs of one seed start from the same warm-up checkpoint, so methods are compared **paired by seed**:
for method M against a baseline B and one agent, d_s = final_M(s) − final_B(s) for every seed s both
finished; the report gives the mean ± (n−1) std of d_s and how many seeds favour each side. The
Markdown tables are one row per seed (final greedy accuracy of every method) and one row per
(method, agent) of paired differences. ``compare.json`` keeps its format (``summary``, ``runs``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

METHOD_LABELS = {"hacpo": "HACPO", "gspo_x2": "GSPO×2", "naive": "Naive", "gspo": "GSPO", "grpo": "GRPO",
                 "hacpo+pessimistic": "HACPO+pess.", "hacpo+adaptive": "HACPO+adapt.", "hacpo+both": "HACPO+both",
                 "hacpo+gspo_clip": "HACPO+GSPO clip", "hacpo+decoupled": "HACPO+decoupled",
                 "hacpo+parity": "HACPO (parity)", "naive_merge": "Naive (merge)",
                 "hacpo+one_step_off": "HACPO (one-step-off)", "hacpo+async2": "HACPO (async, K=2)",
                 "hacpo-adv": "HACPO −Adv", "hacpo-omega": "HACPO −ω", "hacpo-stepwise": "HACPO no-stepwise",
                 "hacpo-clip": "HACPO no-clip", "mutual_prp": "Mutual RL: PRP", "mutual_xgrpo": "Mutual RL: XGRPO",
                 "mutual_sgt": "Mutual RL: SGT", "ftis": "F-TIS"}


class CompareError(ValueError):
    """A comparison cannot run or be reported as asked; the message names the option or file."""


def label(method: str) -> str:
    return METHOD_LABELS.get(method, method)


@dataclass(frozen=True)
class AgentRun:
    """One agent in one finished run: greedy accuracy at each evaluated step, mean clip fractions."""

    steps: list[int]
    accuracy: list[float]
    start: float
    final: float
    cross_clipfrac_mean: float | None
    self_clipfrac_mean: float | None


@dataclass(frozen=True)
class RunResult:
    """One finished (method, seed) run, as ``compare.json``'s ``runs`` entries store it."""

    method: str
    seed: int
    final_step: int
    rollouts_per_agent: int
    wall_s: float | None
    rollout_train_s_per_step: float | None
    agents: dict[str, AgentRun]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunResult:
        return cls(**{**data, "agents": {k: AgentRun(**v) for k, v in data["agents"].items()}})


@dataclass(frozen=True)
class AgentSummary:
    """One agent under one method over seeds: (mean, std) of start, final and their difference."""

    final: tuple[float, float]
    start: tuple[float, float]
    delta: tuple[float, float]
    final_per_seed: list[float]
    start_per_seed: list[float]
    rollouts: int
    curve_steps: list[int]
    curve_mean: list[float]
    cross_clipfrac_mean: float | None
    self_clipfrac_mean: float | None


@dataclass(frozen=True)
class MethodSummary:
    """One method over seeds, as ``compare.json``'s ``summary`` values store it."""

    agents: dict[str, AgentSummary]
    seeds: list[int]
    wall_s_mean: float | None
    rollout_train_s_per_step: float | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MethodSummary:
        agents = {name: AgentSummary(**{**a, **{k: tuple(a[k]) for k in ("final", "start", "delta")}})
                  for name, a in data["agents"].items()}
        return cls(**{**data, "agents": agents})


def load_results(path: Path) -> tuple[dict[str, MethodSummary], list[RunResult]]:
    """The summary and runs of a ``compare.json`` (e.g. benchmarks/COMPARE_cpu_demo.json)."""
    data = json.loads(Path(path).read_text())
    summary = {method: MethodSummary.from_json(entry) for method, entry in data["summary"].items()}
    return summary, [RunResult.from_json(r) for r in data["runs"]]


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and unbiased (n−1) standard deviation; std is 0.0 for a single value."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, std


def summarise(results: list[RunResult], methods: list[str], agent_names: list[str]) -> dict[str, MethodSummary]:
    """method → agent → final, start, delta as (mean, std) over seeds, rollouts, seeds, mean curves."""
    table = {}
    for method in methods:
        mine = [r for r in results if r.method == method]
        rows = {}
        for name in agent_names:
            runs = [r.agents[name] for r in mine]
            finals, starts, steps = [a.final for a in runs], [a.start for a in runs], runs[0].steps
            curves = [a.accuracy for a in runs if a.steps == steps]
            rows[name] = AgentSummary(
                final=mean_std(finals), start=mean_std(starts),
                delta=mean_std([f - s for f, s in zip(finals, starts)]),
                final_per_seed=finals, start_per_seed=starts, rollouts=mine[0].rollouts_per_agent,
                curve_steps=steps, curve_mean=[sum(c[i] for c in curves) / len(curves) for i in range(len(steps))],
                cross_clipfrac_mean=_mean_or_none([a.cross_clipfrac_mean for a in runs]),
                self_clipfrac_mean=_mean_or_none([a.self_clipfrac_mean for a in runs]),
            )
        table[method] = MethodSummary(
            agents=rows, seeds=[r.seed for r in mine], wall_s_mean=_mean_or_none([r.wall_s for r in mine]),
            rollout_train_s_per_step=_mean_or_none([r.rollout_train_s_per_step for r in mine]))
    return table


def _mean_or_none(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def markdown_table(summary: dict[str, MethodSummary], agent_names: list[str]) -> str:
    """One row per (method, agent): final greedy accuracy, change from start, rollouts (mean ± std over seeds)."""
    lines = ["| method | agent | start | final greedy acc. | Δ from start | rollouts / agent | seeds |",
             "|---|---|---|---|---|---|---|"]
    for method, entry in summary.items():
        for name in agent_names:
            a = entry.agents[name]
            lines.append(f"| {label(method)} | {name} | {a.start[0]:.3f} | "
                         f"{a.final[0]:.3f} ± {a.final[1]:.3f} | {a.delta[0]:+.3f} ± {a.delta[1]:.3f} | "
                         f"{a.rollouts} | {len(entry.seeds)} |")
    lines += ["", "| method | wall s per run (mean) | rollout+train s per step | self clip fraction | "
              "cross clip fraction |", "|---|---|---|---|---|"]
    for method, entry in summary.items():
        clips = []
        for key in ("self_clipfrac_mean", "cross_clipfrac_mean"):
            values = [f"{n} {getattr(entry.agents[n], key):.2f}" for n in agent_names
                      if getattr(entry.agents[n], key) is not None]
            clips.append(", ".join(values) or "n/a")
        lines.append(f"| {label(method)} | {_fmt(entry.wall_s_mean, '.0f')} | "
                     f"{_fmt(entry.rollout_train_s_per_step, '.2f')} | {clips[0]} | {clips[1]} |")
    return "\n".join(lines) + "\n"


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def plot_summary(summary: dict[str, MethodSummary], agent_names: list[str], path: Path) -> None:
    """Bar chart of final accuracy (±std error bars) and seed-mean greedy learning curves, one panel per agent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(summary)
    colours = method_colours(methods)  # the same colours as compare_paired.png
    fig, axes = plt.subplots(1, 1 + len(agent_names), figsize=(5 * (1 + len(agent_names)), 4.2))
    width = 0.8 / len(methods)
    ax = axes[0]
    for j, method in enumerate(methods):
        means = [summary[method].agents[n].final[0] for n in agent_names]
        stds = [summary[method].agents[n].final[1] for n in agent_names]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(agent_names))]
        ax.bar(xs, means, width, yerr=stds, capsize=4, label=label(method), color=colours[method])
    ax.set_xticks(range(len(agent_names)), agent_names)
    ax.set_ylabel("final greedy accuracy")
    ax.set_title("final accuracy (mean ± std over seeds)")
    ax.legend(fontsize=8)
    for ax, name in zip(axes[1:], agent_names):
        for method in methods:
            a = summary[method].agents[name]
            ax.plot(a.curve_steps, a.curve_mean, marker="o", ms=3, label=label(method), color=colours[method])
        ax.set_title(f"{name}: greedy eval accuracy (seed mean)")
        ax.set_xlabel("RL step")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# paired by seed


@dataclass(frozen=True)
class PairedDiff:
    """final(method) − final(baseline) of one agent over the seeds both runs finished."""

    method: str
    baseline: str
    agent: str
    seeds: list[int]
    diffs: list[float]

    @property
    def mean_std(self) -> tuple[float, float]:
        return mean_std(self.diffs) if self.diffs else (math.nan, math.nan)

    @property
    def favour(self) -> tuple[int, int, int]:
        """Seeds favouring the method, tied, favouring the baseline."""
        return (sum(d > 0 for d in self.diffs), sum(d == 0 for d in self.diffs), sum(d < 0 for d in self.diffs))


def paired_differences(results: list[RunResult], method: str, baseline: str, agent: str) -> PairedDiff:
    """Per-seed final-accuracy differences of ``method`` against ``baseline`` for ``agent`` (common seeds)."""
    base = {r.seed: r.agents[agent].final for r in results if r.method == baseline}
    mine = {r.seed: r.agents[agent].final for r in results if r.method == method}
    seeds = sorted(set(base) & set(mine))
    return PairedDiff(method, baseline, agent, seeds, [mine[s] - base[s] for s in seeds])


def per_seed_table(results: list[RunResult], methods: list[str], agent_names: list[str]) -> str:
    """One row per seed: each agent's final greedy accuracy under every method ('–' where not run)."""
    finals = {(r.method, r.seed): r for r in results}
    seeds = sorted({r.seed for r in results})
    header = [f"{name} {label(m)}" for name in agent_names for m in methods]
    lines = ["| seed | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for seed in seeds:
        cells = [f"{finals[(m, seed)].agents[name].final:.3f}" if (m, seed) in finals else "–"
                 for name in agent_names for m in methods]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_table(results: list[RunResult], methods: list[str], baseline: str, agent_names: list[str],
                 measure: str = "final acc.") -> str:
    """One row per (method ≠ baseline, agent): mean ± std of the paired differences, seeds for/tied/against.
    ``measure`` names what the runs' ``final`` holds (e.g. "last-3 mean acc." for :func:`last_k_mean` runs)."""
    lines = [f"| paired difference | agent | Δ {measure} (mean ± std) | seeds +/=/− | n | per seed |",
             "|---|---|---|---|---|---|"]
    for method in methods:
        if method == baseline:
            continue
        for name in agent_names:
            d = paired_differences(results, method, baseline, name)
            if not d.seeds:
                continue
            mean, std = d.mean_std
            up, tie, down = d.favour
            per_seed = ", ".join(f"s{s} {v:+.3f}" for s, v in zip(d.seeds, d.diffs))
            lines.append(f"| {label(method)} − {label(baseline)} | {name} | {mean:+.3f} ± {std:.3f} | {up}/{tie}/{down} | "
                         f"{len(d.seeds)} | {per_seed} |")
    return "\n".join(lines) + "\n"


def load_runs(path: Path) -> list[RunResult]:
    return [RunResult.from_json(r) for r in json.loads(Path(path).read_text())["runs"]]


# --------------------------------------------------------------------------------------------
# less noisy finals, several baselines, per-pair cross statistics


def last_k_mean(results: list[RunResult], k: int) -> list[RunResult]:
    """The same runs with each agent's ``final`` replaced by the mean of its last ``k`` greedy evaluations.

    One greedy evaluation on N problems has a binomial standard error of √(p(1−p)/N) (≈ 0.03 at
    p = 0.7, N = 200); averaging the last k evaluations of one run lowers the evaluation noise
    (not the run-to-run noise). k = 1 returns the runs unchanged."""
    if k < 1:
        raise ValueError(f"last k evaluations: k must be >= 1, got {k}")
    if k == 1:
        return list(results)
    out = []
    for r in results:
        agents = {}
        for name, a in r.agents.items():
            tail = a.accuracy[-k:]
            agents[name] = replace(a, final=sum(tail) / len(tail))
        out.append(replace(r, agents=agents))
    return out


def report_tables(results: list[RunResult], methods: list[str], baselines: list[str], agent_names: list[str],
                  last: int = 1) -> str:
    """One row per seed, then paired differences against each baseline; with ``last`` > 1 the same
    again on the mean of the last ``last`` evaluations (:func:`last_k_mean`)."""
    views = [("final greedy accuracy", results, "final acc.")]
    if last > 1:
        views.append((f"mean of the last {last} greedy evaluations", last_k_mean(results, last),
                      f"last-{last} mean acc."))
    parts = []
    for title, view, measure in views:
        parts.append(f"### {title[0].upper()}{title[1:]}, one row per seed\n\n" + per_seed_table(view, methods, agent_names))
        for base in baselines:
            others = [m for m in methods if m != base]
            if others:
                parts.append(f"Paired by seed against {label(base)} ({title}):\n\n"
                             + paired_table(view, others + [base], base, agent_names, measure))
    return "\n".join(parts)


def merge_included(results: list[RunResult], paths: list[Path], methods: list[str], seeds: list[int],
                   agent_names: list[str]) -> list[RunResult]:
    """Runs of earlier comparisons (their ``compare.json``) to report next to ``results``: those of
    ``methods`` × ``seeds`` that ``results`` lacks. Pairing by seed needs the same warm-up and code
    path, so a (method, seed) present in both must have the same greedy curves, else CompareError; a
    seed with no such common run is reported as unverified."""
    ours = {(r.method, r.seed): r for r in results}
    added: dict[tuple[str, int], RunResult] = {}
    verified: set[int] = set()
    for path in paths:
        try:
            runs = load_runs(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CompareError(f"--include {path}: not a compare.json ({type(exc).__name__}: {exc})") from exc
        for run in runs:
            if run.method not in methods or run.seed not in seeds:
                continue
            if sorted(run.agents) != sorted(agent_names):
                raise CompareError(f"--include {path}: {run.method} seed {run.seed} has agents {sorted(run.agents)}, "
                                   f"this comparison {sorted(agent_names)}")
            mine = ours.get((run.method, run.seed))
            if mine is None:
                added.setdefault((run.method, run.seed), run)
                continue
            differ = [a for a in agent_names if mine.agents[a].accuracy != run.agents[a].accuracy
                      or mine.agents[a].steps != run.agents[a].steps]
            if differ:
                raise CompareError(f"--include {path}: {run.method} seed {run.seed} differs from the run in --out "
                                   f"(greedy curve of {differ}): not the same warm-up or code, so its runs "
                                   "cannot be paired with these")
            verified.add(run.seed)
    for method, seed in sorted(added):
        check = "identical common run" if seed in verified else "UNVERIFIED: no common run to check the pairing"
        print(f"[compare] {method} seed {seed}: from --include ({check})", flush=True)
    return [added[key] for key in sorted(added)]


def method_colours(methods: list[str]) -> dict[str, str]:
    """A fixed matplotlib colour per method, in the order given (cycling through the ten tab colours)."""
    return {m: f"C{i % 10}" for i, m in enumerate(methods)}


def plot_paired(results: list[RunResult], methods: list[str], baselines: list[str], agent_names: list[str],
                path: Path) -> None:
    """One panel per (baseline, agent): each method's paired differences to the baseline, one dot per
    seed and the mean ± std as a bar, so the seed-to-seed spread of the methods' own levels (which the
    summary plot's error bars show) does not hide a consistent difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cols = len(baselines), len(agent_names)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    colours = method_colours(methods)  # one colour per method in every panel
    for i, base in enumerate(baselines):
        others = [m for m in methods if m != base]
        for j, name in enumerate(agent_names):
            ax = axes[i][j]
            for x, method in enumerate(others):
                d = paired_differences(results, method, base, name)
                if not d.diffs:
                    continue
                mean, std = d.mean_std
                ax.bar(x, mean, 0.6, yerr=std, capsize=4, alpha=0.5, color=colours[method])
                ax.scatter([x] * len(d.diffs), d.diffs, s=12, color="black", zorder=3)
            ax.axhline(0.0, color="grey", lw=0.8)
            ax.set_xticks(range(len(others)), [label(m) for m in others], rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{name}: method − {label(base)} (per seed)", fontsize=10)
            ax.set_ylabel("Δ accuracy")
            ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def family_results(rows: list[dict[str, Any]], agent_names: list[str]) -> dict[str, AgentRun]:
    """A task with problem families logs ``<agent>/eval/<family>/accuracy``: each (agent, family) as one more
    entry ``<agent>/<family>`` of a run's agents, so every table and paired difference reports it per family."""
    out = {}
    for agent in agent_names:
        keys = sorted({k for r in rows for k in r if k.startswith(f"{agent}/eval/") and k.endswith("/accuracy")})
        for key in keys:
            curve = [(int(r["step"]), r[key]) for r in rows if key in r]
            family = key[len(f"{agent}/eval/"):-len("/accuracy")]
            out[f"{agent}/{family}"] = AgentRun(steps=[s for s, _ in curve], accuracy=[v for _, v in curve],
                                                start=curve[0][1], final=curve[-1][1], cross_clipfrac_mean=None,
                                                self_clipfrac_mean=None)
    return out
