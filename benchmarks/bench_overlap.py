"""What does rollout overlapping training buy? Steady-state step time of each train.rollout_mode.

The CPU demo's two agents with emulated engines (benchmarks/emulated_engine.py: generation sleeps
``tokens / rate``, so rollout costs wall time without taking the 2 cores, as a GPU server would not).
First the synchronous loop measures its own training + sync time T (everything but the rollout);
then each mode runs with the rollout set to r × T for r in --ratios (below, equal to, above training),
a few steps to warm up, then the median of the measured steps. T drifts under load and overlapping
modes add a pass (the behaviour log-probs of stale batches), so every row measures its own T per
step (the step's wall time minus its wait for the rollout: ``rollout/wait_s``, sync
``time/rollout_s``) and sets the next batch's rollout to r × the median T of the row so far; it
reports the rollout and T as measured (medians) and their ratio. Target: one_step_off ≤ 1.1 ×
max(rollout, T); sync ≈ rollout + T. Prints a table and writes JSON (--out).

    python benchmarks/bench_overlap.py --out benchmarks/OVERLAP_emulated.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.emulated_engine import EmulatedEngine  # noqa: E402
from hacrl_megatron.config import load_config  # noqa: E402
from hacrl_megatron.trainer import loop  # noqa: E402

MODES = (("sync", 1), ("one_step_off", 1), ("async", 1), ("async", 2))


def build(out_dir: Path, mode: str, k: int, rollout_s: float | None) -> loop.Run:
    exp = load_config("cpu_demo", [f"output_dir={out_dir}", "train.eval_every=0", "checkpoint.every=0",
                                   "log.progress=false", "log.tensorboard=false", "train.verifier_workers=0",
                                   f"train.rollout_mode={mode}", f"train.max_staleness={k}"])
    run = loop.setup(exp)
    r = exp.rollout
    tokens = exp.train.prompts_per_step * run.algorithm.samples_per_prompt(r.samples_per_prompt) * r.max_response_len
    for rt in run.runtimes:  # both agents' engines take rollout_s (their generation overlaps: separate servers)
        rate = tokens * (5 / 6) / rollout_s if rollout_s else 1e9
        rt.engine = EmulatedEngine(rt.engine, rate)
    run.source.concurrent = True
    run.bench_tokens = tokens * (5 / 6)  # tokens of one batch (a third of the samples end at half length)
    return run


def steady_step(run: loop.Run, warmup: int, steps: int,
                ratio: float | None = None) -> tuple[float, float, float, list[dict[str, float]]]:
    """Median step time, T (the step less its wait for the rollout) and rollout per step over the
    measured steps, and every step's metrics. ``ratio``: after each step the engines' rate is set so
    that the next batch takes ``ratio`` × the median T of the steps so far."""
    history, times, rest, rollout, seen = [], [], [], [], []
    engine = run.runtimes[0].engine
    for i in range(warmup + steps):
        start, slept = time.perf_counter(), getattr(engine, "sleep_s", 0.0)
        metrics = loop.train_step(run)
        step_s = time.perf_counter() - start
        history.append(metrics)
        seen.append(step_s - metrics.get("rollout/wait_s", metrics["time/rollout_s"]))
        if i >= warmup:
            times.append(step_s)
            rest.append(seen[-1])
            rollout.append(getattr(engine, "sleep_s", 0.0) - slept)
        if ratio is not None:
            for rt in run.runtimes:
                rt.engine.tokens_per_s = run.bench_tokens / (ratio * statistics.median(seen))
    return statistics.median(times), statistics.median(rest), statistics.median(rollout), history


def close(run: loop.Run) -> None:
    run.source.close()
    run.verifier.close()
    for rt in run.runtimes:
        rt.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0],
                   help="rollout time / training time")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    results: dict[str, object] = {"ratios": args.ratios}
    with tempfile.TemporaryDirectory() as tmp:
        run = build(Path(tmp) / "probe", "sync", 1, None)  # rollout ~0: the rest of the step is T
        try:
            _, train_s, _, history = steady_step(run, args.warmup, args.steps)
        finally:
            close(run)
        results["train_and_sync_s"] = train_s
        rows = []
        for ratio in args.ratios:
            rollout_s = ratio * train_s
            for mode, k in MODES:
                run = build(Path(tmp) / f"{mode}{k}-{ratio}", mode, k, rollout_s)
                try:
                    step_s, rest_s, rollout_s, history = steady_step(run, args.warmup, args.steps, ratio)
                finally:
                    close(run)
                bound = max(rollout_s, rest_s)
                rows.append({"ratio": ratio, "mode": mode, "max_staleness": k, "rollout_s": rollout_s,
                             "train_s": rest_s, "ratio_measured": rollout_s / rest_s, "step_s": step_s,
                             "sum_s": rollout_s + rest_s, "max_s": bound, "step_over_max": step_s / bound,
                             "speedup_over_sync": None, "staleness": [h.get("llama/staleness", 0.0) for h in history],
                             "wait_s": [h.get("rollout/wait_s", 0.0) for h in history],
                             "sync_s": [h["time/sync_s"] for h in history]})
                print(f"r={ratio:<4} {mode:>12} K={k}: step {step_s:6.2f} s  (rollout {rollout_s:.2f}, T {rest_s:.2f} "
                      f"measured: r = {rollout_s / rest_s:.2f}; sum {rollout_s + rest_s:.2f}, max {bound:.2f}: "
                      f"{step_s / bound:.2f}x max)", flush=True)
        for row in rows:
            sync = next(r for r in rows if r["ratio"] == row["ratio"] and r["mode"] == "sync")
            row["speedup_over_sync"] = sync["step_s"] / row["step_s"]
        results["rows"] = rows
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
