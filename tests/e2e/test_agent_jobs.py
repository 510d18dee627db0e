"""Agents as separate jobs (`hacrl train --agent NAME`, docs/exchange.md) against the one-process run.

Two `hacrl train --agent` processes of cpu_demo (HF backend, the shipped warm-ups), each with its own
output folder, meeting through the exchange, must log every per-agent metric of the one-process run
with the same seeds bit for bit, and write byte-identical final weights: both runs are deterministic
on one machine (same seeds, same kernels, same order of every float operation: the peer's records
carry its Σ log π_old and rewards as exact JSON floats), so exact equality holds on any CPU as long
as both runs use the same one. Timing metrics and the jobs' own exchange metrics are left out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.redis_server import redis_server  # noqa: F401 - the fixture

AGENTS = ("llama", "qwen3")
STEPS = 5
# 5 steps with an evaluation (20 held-out prompts) at the end, samples on step 1 and 5, no TensorBoard
COMMON = [f"train.steps={STEPS}", "train.eval_every=5", "data.eval_size=20", "log.tensorboard=false",
          "log.progress=false", "checkpoint.every=0", "log.samples_every=5", "train.verifier_workers=0"]
# metrics that measure time or the job itself, not the training
NOT_COMPARED = ("time/", "_per_s", "/trainer/", "/exchange/wait_s", "/exchange/peers_missing")


def hacrl(args: list[str], cwd: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "hacrl_megatron", "train", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def per_agent(rows: list[dict], agent: str) -> list[dict]:
    return [{k: v for k, v in row.items() if k.startswith(f"{agent}/") and not any(s in k for s in NOT_COMPARED)}
            for row in rows]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The one-process run of the same config (every agent under one controller)."""
    folder = tmp_path_factory.mktemp("joint")
    finish(hacrl([*COMMON, f"output_dir={folder / 'run'}"], folder))
    return folder / "run"


def run_jobs(tmp_path: Path, exchange: list[str]) -> dict[str, Path]:
    procs = {a: hacrl(["--agent", a, *COMMON, *exchange, f"output_dir={tmp_path / a}"], tmp_path) for a in AGENTS}
    for proc in procs.values():
        finish(proc)
    return {a: tmp_path / a for a in AGENTS}


def assert_same_as_one_process(jobs: dict[str, Path], joint: Path, min_metrics: int = 30) -> None:
    joint_rows = metrics(joint)
    for agent, folder in jobs.items():
        rows = metrics(folder)
        assert len(rows) == len(joint_rows) == STEPS + 1  # and the evaluation before the first step
        mine, theirs = per_agent(rows, agent), per_agent(joint_rows, agent)
        assert [sorted(r) for r in mine] == [sorted(r) for r in theirs]
        assert len(mine[-1]) > min_metrics and f"{agent}/eval_accuracy" in mine[-1]  # losses, ratios, ω, rewards ...
        assert mine == theirs
        assert all(r[f"{agent}/exchange/peers_missing"] == 0.0 for r in rows[1:])  # rows[0]: the evaluation at 0
        ours = (folder / "final" / agent / "model.safetensors").read_bytes()
        assert ours == (joint / "final" / agent / "model.safetensors").read_bytes()


def test_separate_jobs_through_a_shared_folder_equal_the_one_process_run(one_process, tmp_path):
    exchange = ["exchange.backend=shared_dir", f"exchange.dir={tmp_path / 'exchange'}", "exchange.wait_s=300"]
    assert_same_as_one_process(run_jobs(tmp_path, exchange), one_process)
    # one human-readable record per (step, agent) (kept: fewer steps than exchange.keep_steps, 8), each
    # job's claim of its agent, and the run documents: the first job drew the nonce, the second joined it
    folder = tmp_path / "exchange" / "cpu_demo"
    records = sorted(p.name for p in folder.iterdir())
    assert records == sorted([f"step-{s:08d}.{a}.json" for s in range(STEPS) for a in AGENTS]
                             + [f"claim.{a}" for a in AGENTS] + ["run.00000001.json", "run.00000002.json"])
    joined = json.loads((folder / "run.00000002.json").read_text())
    assert sorted(joined["agents"]) == sorted(AGENTS)
    assert json.loads((folder / "run.00000001.json").read_text())["nonce"] == joined["nonce"]
    first = json.loads((folder / "step-00000000.qwen3.json").read_text())
    assert first["agent"] == "qwen3" and len(first["responses"]) == 16 and len(first["responses"][0]) == 8
    assert first["run_nonce"] == joined["nonce"] and "data.checker" in first["config_fields"]


@pytest.mark.redis
def test_separate_jobs_through_redis_equal_the_one_process_run(one_process, tmp_path, redis_server):  # noqa: F811
    exchange = ["exchange.backend=redis", f"exchange.redis_url={redis_server.url}",
                f"exchange.redis_password_file={redis_server.password_file}", "exchange.wait_s=300",
                f"exchange.run_id=redis-{tmp_path.name}"]
    assert_same_as_one_process(run_jobs(tmp_path, exchange), one_process)


@pytest.mark.slow
def test_separate_jobs_equal_the_one_process_run_with_rollout_one_step_off(tmp_path):
    """The overlapping mode: a record of a batch sampled one version back carries Σ log π_behav, which a
    peer's learner takes as the cross row's proximal policy, as the one-process run does (algorithm.md §7b)."""
    mode = ["train.rollout_mode=one_step_off"]
    finish(hacrl([*COMMON, *mode, f"output_dir={tmp_path / 'joint'}"], tmp_path))
    exchange = [*mode, "exchange.backend=shared_dir", f"exchange.dir={tmp_path / 'exchange'}", "exchange.wait_s=300"]
    jobs = run_jobs(tmp_path, exchange)
    assert_same_as_one_process(jobs, tmp_path / "joint")
    assert metrics(jobs["llama"])[-1]["llama/staleness"] == 1.0


@pytest.mark.slow
def test_separate_jobs_of_success_gated_transfer_equal_the_one_process_run(tmp_path):
    """docs/algorithm.md §8a: SGT takes the peer's rewards (its rescue sets), its responses and, for the
    transferred successes, the learner's π_old over them, computed after the exchange. One method stands for
    the four: XGRPO reads only the rewards, and PRP / F-TIS read what SGT reads (for every peer response) plus
    the author's log-prob sums, which HACPO's separate jobs above exchange already."""
    algorithm = ["hacpo.algorithm=mutual_sgt"]
    finish(hacrl([*COMMON, *algorithm, f"output_dir={tmp_path / 'joint'}"], tmp_path))
    exchange = [*algorithm, "exchange.backend=shared_dir", f"exchange.dir={tmp_path / 'exchange'}",
                "exchange.wait_s=300"]
    # fewer metrics than HACPO's: SGT has no peer rows on a step with nothing to rescue
    assert_same_as_one_process(run_jobs(tmp_path, exchange), tmp_path / "joint", min_metrics=20)


@pytest.mark.slow
def test_launch_per_agent_jobs_trains_every_agent_as_its_own_local_job(tmp_path):
    """`hacrl launch --per-agent-jobs` on the local executor: a NeMo-Run job per agent, run at once, each
    writing to <output_dir>/<agent>, meeting through the shared folder."""
    pytest.importorskip("nemo_run")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "hacrl_megatron", "launch", "--base-dir", str(tmp_path / "nemo"),
                           "--name", "sep", "--per-agent-jobs", "train.steps=2", "train.eval_every=0",
                           "log.progress=false", "log.tensorboard=false", f"output_dir={out}",
                           "exchange.backend=shared_dir", f"exchange.dir={tmp_path / 'exchange'}"],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "hacrl launch: agent 'llama': exit 0" in done.stderr and "hacrl launch: agent 'qwen3': exit 0" in done.stderr
    for agent in AGENTS:
        rows = metrics(out / agent)
        assert [r[f"{agent}/exchange/peers_missing"] for r in rows] == [0.0, 0.0]
        assert (out / agent / "final" / agent / "model.safetensors").is_file()
