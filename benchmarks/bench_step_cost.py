"""HACPO vs GSPO×2 cost per step, stage by stage, in one process (docs/algorithm.md §8).

    python benchmarks/bench_step_cost.py [--preset cpu_demo] [--steps 3] [--repeats 3] [--set key=value ...]
                                         [--json OUT.json]
    python benchmarks/bench_step_cost.py --project PLAN.json [--train-factor 1.05] [--cross-old-pass]
                                         # GPU-cluster projection

Both runs are built once from the same warm-up (``train.sft_warmup`` reads the cache) and make
the same number of optimizer updates per step (``train.mini_batches``). They then run
``--steps`` steps each, alternately, ``--repeats`` times (the order flips every repeat), so that
load swings on a shared machine hit both alike. Step i of either run samples the same prompts.

Per stage (rollout, verify, old log-probs, train, sync) it reports the median wall time and process
CPU time per step and the ratio HACPO / GSPO×2, and splits the train stage into the learner
batch (re-tokenizing the other agent's responses, advantages: ``stages.learner_batch``) and the
agents' updates. Token counts say where the work differs: sequences and response tokens each
learner trains on, the tokens of the longest sequence × sequences (what a right-padded batch
computes), and the tokens each old-log-prob pass reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hacrl_megatron.algo import positive_rate  # noqa: E402
from hacrl_megatron.config import load_config  # noqa: E402
from hacrl_megatron.exchange.retokenize import Exchange  # noqa: E402
from hacrl_megatron.trainer import loop, stages  # noqa: E402

METHODS = ("hacpo", "gspo_x2")
STAGES = ("rollout", "verify", "old_logprob", "learner_batch", "update", "sync")


class Meter:
    """Wall and process CPU seconds of named sections, plus token counters, for the current step."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.counts: dict[str, float] = defaultdict(float)

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - w
                self.cpu[name] += time.process_time() - c
        return wrapper


class Current:
    """The meter of the step being measured (the patched functions below report to it)."""

    meter = Meter()


def instrument() -> None:
    """Once: time the learner batch and the exchange's re-tokenization inside the loop's own calls,
    and count the tokens each learner trains on."""
    batch_fn, views_fn, split_fn = stages.learner_batch, Exchange.views, stages.split_mini_batches

    def learner_batch(*args: Any, **kwargs: Any):
        batch = Current.meter.timed("learner_batch", batch_fn)(*args, **kwargs)
        counts = Current.meter.counts
        counts["train_sequences"] += len(batch)
        counts["train_response_tokens"] += int(batch.response_lens.sum())
        counts["train_tokens"] += batch.num_tokens()
        return batch

    def split(batch, num, seed):
        minis = split_fn(batch, num, seed)
        padded = sum(len(m) * max(ids.numel() for ids in m.input_ids) for m in minis)
        Current.meter.counts["train_padded_tokens"] += padded
        return minis

    def views(self, *args: Any, **kwargs: Any):
        return Current.meter.timed("exchange_views", views_fn)(self, *args, **kwargs)

    stages.learner_batch = learner_batch
    stages.split_mini_batches = split
    Exchange.views = views


def step(run: loop.Run, meter: Meter) -> None:
    """One step of ``loop.train_step``'s stages, each timed (wall and CPU)."""
    exp, n = run.exp, run.step
    prompts = run.task.sample(exp.train.prompts_per_step, offset=n * exp.train.prompts_per_step)
    completions = meter.timed("rollout", stages.rollout)(run.runtimes, prompts, exp, run.algorithm, n)
    data = meter.timed("verify", stages.verify)(run.verifier, prompts, completions, n, exp.rollout.max_response_len + 1)
    sampled = sum(len(t.token_ids) for ts in data.trajectories.values() for t in ts)
    # each agent scores its own responses; under §5d (decoupled) every learner scores every agent's,
    # i.e. n passes over all of them (counted in the source's tokens)
    passes = len(run.runtimes) if run.algorithm.passes.learner_old_on_others else 1
    meter.counts["old_logprob_tokens"] += sampled * passes
    meter.timed("old_logprob", stages.old_logprobs)(run.runtimes, data, run.exchange, run.algorithm,
                                                    exp.rollout.temperature)
    run.tracker.update([positive_rate(data.rewards[:, i]) for i in range(len(run.runtimes))])
    metrics = meter.timed("train", loop._update_learners)(run, data, run.tracker.omega(), n)
    run.algorithm.record_cross_statistics(run.tracker, metrics, run.names)
    meter.timed("sync", loop._sync_engines)(run, prompts[0])
    run.exchange.pop_metrics("")
    run.step += 1


def build(preset: str, method: str, sets: list[str], root: Path) -> loop.Run:
    exp = load_config(preset, [*sets, f"hacpo.algorithm={method}", f"output_dir={root / method}", "train.eval_every=0",
                               "checkpoint.every=0", "log.progress=false", "log.tensorboard=false"])
    return loop.setup(exp)


def measure(runs: dict[str, loop.Run], steps: int, repeats: int) -> dict[str, list[Meter]]:
    per_step: dict[str, list[Meter]] = {m: [] for m in runs}
    instrument()
    for r in range(repeats):
        for method in (METHODS if r % 2 == 0 else METHODS[::-1]):
            for _ in range(steps):
                meter = Current.meter = Meter()
                step(runs[method], meter)
                per_step[method].append(meter)
                print(f"[bench] repeat {r} {method} step {runs[method].step}: train {meter.wall['train']:.2f} s wall",
                      flush=True)
    return per_step


def summarise(per_step: dict[str, list[Meter]]) -> dict[str, Any]:
    """Median per step of every section (wall, CPU) and counter, and the HACPO / GSPO×2 ratios."""
    out: dict[str, Any] = {}
    for method, meters in per_step.items():
        sections = sorted({k for m in meters for k in m.wall})
        out[method] = {
            "wall_s": {k: statistics.median(m.wall[k] for m in meters) for k in sections},
            "cpu_s": {k: statistics.median(m.cpu[k] for m in meters) for k in sections},
            "counts": {k: statistics.median(m.counts[k] for m in meters) for k in sorted(meters[0].counts)},
            "steps": len(meters),
        }
        for kind in ("wall_s", "cpu_s"):
            med = out[method][kind]
            med["update"] = med.get("train", 0.0) - med.get("learner_batch", 0.0)
            med["step"] = sum(med.get(k, 0.0) for k in ("rollout", "verify", "old_logprob", "train", "sync"))
    h, g = out["hacpo"], out["gspo_x2"]
    out["ratio"] = {kind: {k: h[kind][k] / g[kind][k] for k in h[kind] if g[kind].get(k)} for kind in ("wall_s", "cpu_s")}
    return out


def table(summary: dict[str, Any]) -> str:
    lines = ["| stage | HACPO wall s | GSPO×2 wall s | ratio | HACPO CPU s | GSPO×2 CPU s | ratio |",
             "|---|---|---|---|---|---|---|"]
    h, g, r = summary["hacpo"], summary["gspo_x2"], summary["ratio"]
    for k in (*STAGES, "exchange_views", "step"):
        cells = []
        for kind in ("wall_s", "cpu_s"):
            cells += [f"{h[kind].get(k, 0):.3f}", f"{g[kind].get(k, 0):.3f}",
                      f"{r[kind][k]:.2f}" if k in r[kind] else "–"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", "| per step (both learners) | HACPO | GSPO×2 |", "|---|---|---|"]
    for k in h["counts"]:
        lines.append(f"| {k} | {h['counts'][k]:.0f} | {g['counts'].get(k, 0):.0f} |")
    return "\n".join(lines)


def project(plan: dict[str, Any], train_factor: float, cross_old_pass: bool = False) -> dict[str, Any]:
    """A GPU-cluster step of HACPO and GSPO×2 from a ``hacrl plan --json`` experiment plan.

    The planner prices, per agent, rollout (G and 2G samples per prompt), training and sync; its
    train_s counts (6 + r)·N FLOPs per trained token (r = 2 with full recompute) plus 2·N for a π_old
    pass over all n·P·G trained sequences. That is GSPO×2's work (2·P·G own sequences, old pass over the
    same). HACPO trains on the same n·P·G sequences but each agent's old pass covers only its own P·G
    (docs/algorithm.md §3), and its trained sequences cost ``train_factor`` times as much (the measured
    padding / re-tokenized length ratio). Per agent: T_HACPO = train_s·((6 + r)·train_factor + 2/n)/(8 + r).
    ``cross_old_pass`` (``hacpo.cross_clip_mode=decoupled``, docs/algorithm.md §5d): each agent's old pass
    also covers the others' responses, 2 in place of 2/n. Agents run side by side: each component of the
    step is the slowest agent's.
    """
    n = len(plan["agents"])
    old_pass = 2.0 if cross_old_pass else 2 / n
    rows = []
    for agent in plan["agents"]:
        t = agent["time_s"]
        r = 2.0 if agent["layout"]["recompute"] == "full" else 0.0
        train = t["train_s"] + t.get("old_logprob_s", 0.0)  # plans since the staged schedule price π_old apart
        rows.append({"rollout": (t["rollout_s"], t["gspo_x2_rollout_s"]),
                     "train": (train * ((6 + r) * train_factor + old_pass) / (8 + r), train),
                     "sync": (t["sync_s"], t["sync_s"])})
    out = {k: tuple(max(row[k][i] for row in rows) for i in (0, 1)) for k in ("rollout", "train", "sync")}
    out["step"] = tuple(sum(out[k][i] for k in ("rollout", "train", "sync")) for i in (0, 1))
    return {k: {"hacpo_s": v[0], "gspo_x2_s": v[1], "ratio": v[0] / v[1]} for k, v in out.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu_demo")
    p.add_argument("--steps", type=int, default=3, help="steps per method per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--set", nargs="*", default=[], dest="sets", metavar="key=value")
    p.add_argument("--json", type=Path, default=None, help="write every number here")
    p.add_argument("--project", type=Path, default=None, metavar="PLAN.json",
                   help="only project a `hacrl plan --json` experiment plan with --train-factor, no measurement")
    p.add_argument("--train-factor", type=float, default=1.0,
                   help="HACPO / GSPO×2 cost of the trained sequences (e.g. the measured update CPU ratio)")
    p.add_argument("--cross-old-pass", action="store_true",
                   help="project hacpo.cross_clip_mode=decoupled: each agent's π_old pass covers every agent's responses")
    args = p.parse_args(argv)
    if args.project:
        projected = project(json.loads(args.project.read_text()), args.train_factor, args.cross_old_pass)
        print("| stage | HACPO s | GSPO×2 s | ratio |\n|---|---|---|---|")
        for k, v in projected.items():
            print(f"| {k} | {v['hacpo_s']:.1f} | {v['gspo_x2_s']:.1f} | {v['ratio']:.2f} |")
        return projected
    with tempfile.TemporaryDirectory(prefix="bench_step_cost_") as tmp:
        runs = {m: build(args.preset, m, args.sets, Path(tmp)) for m in METHODS}
        try:
            summary = summarise(measure(runs, args.steps, args.repeats))
        finally:
            for run in runs.values():
                run.verifier.close()
                for rt in run.runtimes:
                    rt.close()
    print(table(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1, sort_keys=True))
    return summary


if __name__ == "__main__":
    main()
