"""Is the rollout stage the slower agent's time, not the sum? (issue: every stage runs all agents at once)

Two agents of the CPU demo with emulated engines (benchmarks/emulated_engine.py: generation sleeps
``tokens / rate``, so it costs wall time without taking the 2 cores) at two rates, so that one agent's
rollout takes about twice the other's. The rollout stage is timed through the loop's own
``stages.rollout``: once with the engines declared in-process (agents one after another, the old
schedule) and once as they are (remote: concurrent). Prints, and writes to --out as JSON: each agent's
time alone, the sequential and the concurrent stage time, and the ratio concurrent / slower agent
(target ≤ 1.15). Also times whole steps (``loop.train_step``) both ways.

    python benchmarks/bench_concurrency.py --out benchmarks/CONCURRENCY_emulated.json
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
from hacrl_megatron.trainer import loop, stages  # noqa: E402


def build(out_dir: Path, rollout_s: list[float]) -> tuple[loop.Run, list[EmulatedEngine]]:
    exp = load_config("cpu_demo", [f"output_dir={out_dir}", "train.eval_every=0", "checkpoint.every=0",
                                   "log.progress=false", "log.tensorboard=false", "train.verifier_workers=0"])
    run = loop.setup(exp)
    r = exp.rollout
    tokens = exp.train.prompts_per_step * run.algorithm.samples_per_prompt(r.samples_per_prompt) * r.max_response_len
    engines = []
    for rt, seconds in zip(run.runtimes, rollout_s):
        # about 2/3 of the samples run to max_response_len (finish_eos_every=3 halves the others)
        rt.engine = EmulatedEngine(rt.engine, tokens * (5 / 6) / seconds)
        engines.append(rt.engine)
    return run, engines


def time_rollout(run: loop.Run, step: int) -> float:
    prompts = run.task.sample(run.exp.train.prompts_per_step, offset=step * run.exp.train.prompts_per_step)
    start = time.perf_counter()
    stages.rollout(run.runtimes, prompts, run.exp, run.algorithm, step)
    return time.perf_counter() - start


def measure(run: loop.Run, engines: list[EmulatedEngine], repeats: int) -> dict[str, float]:
    alone = []
    for rt in run.runtimes:  # each agent alone
        others = run.runtimes
        run.runtimes = [rt]
        alone.append(statistics.median(time_rollout(run, s) for s in range(repeats)))
        run.runtimes = others
    for e in engines:
        e.runs_in_process = True  # the old schedule: one agent after the other
    sequential = statistics.median(time_rollout(run, s) for s in range(repeats))
    for e in engines:
        e.runs_in_process = False
    concurrent = statistics.median(time_rollout(run, s) for s in range(repeats))
    steps = {}
    for label, flag in (("sequential", True), ("concurrent", False)):
        for e in engines:
            e.runs_in_process = flag
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            metrics = loop.train_step(run)
            times.append(time.perf_counter() - start)
        steps[label] = statistics.median(times)
        steps[f"{label}_rollout_stage"] = metrics["time/rollout_s"]
    return {"alone_s": alone, "slower_agent_s": max(alone), "sum_s": sum(alone), "sequential_s": sequential,
            "concurrent_s": concurrent, "ratio_to_slower": concurrent / max(alone),
            "step_sequential_s": steps["sequential"], "step_concurrent_s": steps["concurrent"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rollout-s", type=float, nargs=2, default=[2.0, 1.0], help="each agent's emulated rollout time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run, engines = build(Path(tmp) / "run", args.rollout_s)
        try:
            result = measure(run, engines, args.repeats)
        finally:
            for rt in run.runtimes:
                rt.close()
            run.verifier.close()
    result["rollout_s_set"] = args.rollout_s
    print(f"rollout stage, agents alone: {', '.join(f'{t:.2f} s' for t in result['alone_s'])}")
    print(f"one after another: {result['sequential_s']:.2f} s (sum {result['sum_s']:.2f} s)")
    print(f"concurrent:        {result['concurrent_s']:.2f} s = {result['ratio_to_slower']:.3f} x the slower agent")
    print(f"whole step: {result['step_sequential_s']:.2f} s sequential, {result['step_concurrent_s']:.2f} s concurrent")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
