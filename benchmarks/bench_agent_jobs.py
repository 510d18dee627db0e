"""Per-step cost of training the agents as separate jobs (`hacrl train --agent NAME`) against one process.

Runs cpu_demo for ``--steps`` steps three ways on this machine: one process (``exchange.backend=local``,
every agent under one controller), then two `hacrl train --agent` jobs at once through ``shared_dir``
(a local folder) and through ``redis`` (a redis-server this script starts on 127.0.0.1 with a password;
skipped when none is on PATH). Prints, per way and job, the median over steps 2..N of the step's wall
time (the sum of its ``time/*_s`` phases), of ``time/exchange_s`` (publish + wait + merge + the learner's
pass over the peer's responses) and of ``<agent>/exchange/wait_s`` (the wait alone: mostly the barrier
for the slower peer), and writes them to ``benchmarks/AGENT_JOBS_overhead.json``.

    python benchmarks/bench_agent_jobs.py [--steps 10] [--out benchmarks/AGENT_JOBS_overhead.json]

The jobs share the machine's cores, as they would share nothing on a cluster: on a 2-core machine the
two jobs run side by side, so their step can be shorter than the one process's, which runs the agents
one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

AGENTS = ("llama", "qwen3")


def train(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hacrl_megatron", "train", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"a training job failed (exit {proc.returncode}):\n{out[-3000:]}")


def medians(folder: Path, agent: str | None) -> dict[str, float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()][1:]  # step 1 warms up
    step = [sum(v for k, v in r.items() if k.startswith("time/") and k.endswith("_s")) for r in rows]
    out = {"step_s": statistics.median(step)}
    if agent is not None:
        out["exchange_s"] = statistics.median(r["time/exchange_s"] for r in rows)
        out["wait_s"] = statistics.median(r[f"{agent}/exchange/wait_s"] for r in rows)
    return {k: round(v, 3) for k, v in out.items()}


def run_jobs(work: Path, common: list[str], exchange: list[str], name: str) -> dict[str, dict[str, float]]:
    started = time.perf_counter()
    wait([train(["--agent", a, *common, *exchange, f"output_dir={work / name / a}"], work) for a in AGENTS])
    found = {a: medians(work / name / a, a) for a in AGENTS}
    found["wall_s"] = round(time.perf_counter() - started, 1)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "AGENT_JOBS_overhead.json"))
    args = parser.parse_args()
    common = [f"train.steps={args.steps}", "train.eval_every=0", "log.tensorboard=false", "log.progress=false",
              "checkpoint.every=0", "log.samples_every=0", "exchange.wait_s=600"]
    results: dict[str, object] = {"steps": args.steps, "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="hacrl-agent-jobs-") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        wait([train([*common, f"output_dir={work / 'local'}"], work)])
        results["local"] = {**medians(work / "local", None), "wall_s": round(time.perf_counter() - started, 1)}
        results["shared_dir"] = run_jobs(work, common, ["exchange.backend=shared_dir", f"exchange.dir={work / 'ex'}"],
                                         "shared_dir")
        if shutil.which("redis-server"):
            from tests.fixtures.redis_server import start_redis, stop_redis

            (work / "redis").mkdir()
            proc, server = start_redis(work / "redis")
            try:
                results["redis"] = run_jobs(work, common, ["exchange.backend=redis", f"exchange.redis_url={server.url}",
                                                           f"exchange.redis_password_file={server.password_file}"],
                                            "redis_jobs")
            finally:
                stop_redis(proc)
    results["load_avg_end"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
