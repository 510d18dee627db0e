"""What does rollout overlapping training buy? Steady-state step time of each train.rollout_mode.

The CPU demo's two agents with emulated engines (benchmarks/emulated_engine.py: generation sleeps
``tokens / rate``, so rollout costs wall time without taking the 2 cores, as a GPU server would not).
First the synchronous loop measures its own training + sync time T (everything but the rollout);
then each mode runs with the rollout set to r × T for r in --ratios (below, equal to, above training),
a few steps to warm up, then the median of the measured steps. Target: one_step_off ≤ 1.1 ×
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
    return run


def steady_step(run: loop.Run, warmup: int, steps: int) -> tuple[float, list[dict[str, float]]]:
    history, times = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        history.append(loop.train_step(run))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), history


def close(run: loop.Run) -> None:
    run.source.close()
    run.verifier.close()
    for rt in run.runtimes:
        rt.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="rollout time / training time")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    results: dict[str, object] = {"ratios": args.ratios}
    with tempfile.TemporaryDirectory() as tmp:
        run = build(Path(tmp) / "probe", "sync", 1, None)  # rollout ~0: the rest of the step is T
        try:
            train_s, history = steady_step(run, args.warmup, args.steps)
        finally:
            close(run)
        results["train_and_sync_s"] = train_s
        rows = []
        for ratio in args.ratios:
            rollout_s = ratio * train_s
            for mode, k in MODES:
                run = build(Path(tmp) / f"{mode}{k}-{ratio}", mode, k, rollout_s)
                try:
                    step_s, history = steady_step(run, args.warmup, args.steps)
                finally:
                    close(run)
                bound = max(rollout_s, train_s)
                rows.append({"ratio": ratio, "mode": mode, "max_staleness": k, "rollout_s": rollout_s,
                             "step_s": step_s, "sum_s": rollout_s + train_s, "max_s": bound,
                             "step_over_max": step_s / bound, "speedup_over_sync": None,
                             "staleness": [h.get("llama/staleness", 0.0) for h in history]})
                print(f"r={ratio:<4} {mode:>12} K={k}: step {step_s:6.2f} s  (rollout {rollout_s:.2f}, train+sync "
                      f"{train_s:.2f}; sum {rollout_s + train_s:.2f}, max {bound:.2f}: {step_s / bound:.2f}x max)",
                      flush=True)
        for row in rows:
            sync = next(r for r in rows if r["ratio"] == row["ratio"] and r["mode"] == "sync")
            row["speedup_over_sync"] = sync["step_s"] / row["step_s"]
        results["rows"] = rows
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
