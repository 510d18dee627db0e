"""`hacrl launch --executor slurm` through NeMo-Run into the real two-node Slurm of tools/slurm_testbed.py.

The job starts the Ray head on n1 (127.0.0.2) and a Ray worker on n2 (127.0.0.3), runs
``hacrl train`` on the head and ends with its status. While a job runs, a watcher samples every
process of the bed's tasks: both nodes' addresses must be listening (each Ray node took its
node's address), nothing may listen on a particular non-loopback address, every connection must
go to a loopback address, and Ray actors are counted per node. After each test the fixture checks that no job and no process of the bed is left.

Failure paths: a failing command makes the job FAILED; ``scancel`` mid-run leaves a run folder
that resumes; ``--requeue`` with ``checkpoint.resume=true`` survives ``scontrol requeue`` by resuming.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hacrl_megatron.trainer.checkpoint import find_resume_checkpoint
from tests.slurm.conftest import bed_module, describe
from tests.slurm.test_slurm_bed import sacct_state

pytestmark = [pytest.mark.slow, pytest.mark.slurm]
psutil = pytest.importorskip("psutil")
pytest.importorskip("nemo_run")
pytest.importorskip("ray")

FAST = ["data.eval_size=16", "train.eval_every=100", "train.prompts_per_step=4", "rollout.samples_per_prompt=4"]


class Watch(threading.Thread):
    """Samples the bed's task processes every ``period_s``: listening and peer addresses, and the
    Slurm node of every Ray actor process (``ray::<Class>`` in its command line)."""

    def __init__(self, bed, period_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.bed, self.period_s = bed, period_s
        self.listening: set[tuple[str, int, str]] = set()  # (address, port, process name)
        self.peers: set[tuple[str, str]] = set()
        self.actor_nodes: dict[str, set[str]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period_s):
            for pid in self.bed.leftovers():
                self._sample(pid)

    def _sample(self, pid: int) -> None:
        try:
            p = psutil.Process(pid)
            conns = p.net_connections(kind="inet")
            cmd = p.cmdline()
        except (psutil.Error, OSError):
            return
        node = self.bed.node_of(pid) or "?"  # Ray's titled processes may show no environment
        name = os.path.basename(cmd[0]) if cmd else "?"
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                self.listening.add((_v4(c.laddr.ip), c.laddr.port, name))
            elif c.raddr:
                self.peers.add((_v4(c.raddr.ip), name))
        if cmd and cmd[0].startswith("ray::") and not cmd[0].startswith("ray::IDLE"):
            self.actor_nodes.setdefault(cmd[0].split()[0], set()).add(node)

    def __enter__(self) -> Watch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.join(30)

    def check_loopback_only(self) -> None:
        """Both nodes' addresses had listeners (each node's Ray took its Slurm address); no socket
        listened on a particular non-loopback address (the host's own, say); every connection went
        to a loopback address. Wildcard listeners (0.0.0.0, ::) are allowed: Ray 2.60 binds its gRPC
        servers (GCS, raylet, object manager, workers, the dashboard agent) to every interface
        whatever --node-ip-address says, and srun binds the wildcard (tools/slurm_testbed.py); they
        are reached at the node addresses only, which the peer check confirms."""
        ips = {ip for ip, _, _ in self.listening}
        assert {"127.0.0.2", "127.0.0.3"} <= ips, sorted(self.listening)
        off = sorted(x for x in self.listening if not x[0].startswith("127.") and x[0] not in WILDCARD)
        assert not off, f"listening on a non-loopback address: {off}"
        assert self.peers and all(ip.startswith("127.") for ip, _ in self.peers), \
            f"talking off loopback: {sorted(p for p in self.peers if not p[0].startswith('127.'))}"


WILDCARD = {"0.0.0.0", "::"}
def _v4(ip: str) -> str:
    """An IPv4-mapped IPv6 address (a dual-stack socket) as IPv4."""
    return ip.removeprefix("::ffff:")


def launch(bed, tmp_path: Path, name: str, *args: str, overrides: list[str], detach: bool = False,
           timeout_s: float = 1800) -> subprocess.CompletedProcess:
    """``hacrl launch --executor slurm --nodes 2`` of cpu_demo into the bed (job files under tmp_path). The Ray
    port (and the next one: `--per-agent-jobs` gives its second job `--ray-port` + 1) comes from outside the
    kernel's ephemeral range, so nothing else on the machine takes it before the job's head binds it."""
    ray_port = bed_module.quiet_ports(2, consecutive=True)[0]
    env = bed.env()
    env.update(NEMORUN_HOME=str(tmp_path / "nemorun"), PYTHONUNBUFFERED="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    argv = [sys.executable, "-m", "hacrl_megatron", "launch", "--executor", "slurm", "--nodes", "2",
            "--account", "hacrl", "--partition", "hacrl", "--container-image", "none", "--packager", "none",
            "--job-dir", str(tmp_path / "jobs"), "--name", name,
            "--ray-port", str(ray_port), "--ray-wait-timeout", "900", "--time", "01:00:00",
            "--env", "OMP_NUM_THREADS=1", *args, *(["--detach"] if detach else []),
            "--preset", "cpu_demo", f"output_dir={tmp_path / 'run'}", *FAST, *overrides]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


def job_id(bed, name: str, timeout_s: float = 60.0) -> str:
    """The Slurm id of NeMo-Run's job for task ``name`` (its job name is ``<account>-<account>.<name>``);
    the accounting record follows the submission by a moment."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["sacct", "-n", "-X", "-P", f"--name=hacrl-hacrl.{name}", "-o", "JobID"],
                             capture_output=True, text=True, env=bed.env(), check=True)
        ids = out.stdout.split()
        if ids or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(ids) == 1, out.stdout
    return ids[0]


def job_logs(tmp_path: Path) -> str:
    return "\n".join(f"== {p}\n{p.read_text(errors='replace')}" for p in sorted((tmp_path / "jobs").rglob("*.out")))


def metrics_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def checkpointed(run: Path) -> int:
    """The newest complete checkpoint's step (0: none yet)."""
    return max((int(c.parent.name[-6:]) for c in (run / "checkpoints").glob("step-*/COMPLETE")), default=0)


def wait_for(what: str, ready, timeout_s: float, poll_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(poll_s)


def assert_nothing_outlives_the_job(bed) -> None:
    """A completed job leaves no process: the other nodes stop their Ray before the head's GCS
    goes (slurm_ray.py); one stopped after it waits out Ray's timeouts (30 s to drain, a minute in
    each agent), the agents outside the job step where Slurm's linuxproc tracking cannot end them."""
    deadline = time.monotonic() + 15
    while (left := bed.leftovers()) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"processes of the finished job still running: {describe(left)}"


@pytest.mark.timeout(2400)
def test_cpu_demo_trains_across_two_slurm_nodes(bed, tmp_path):
    with Watch(bed) as watch:
        out = launch(bed, tmp_path, "demo", overrides=["train.steps=3"])
    logs = job_logs(tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + logs[-6000:]
    assert "demo SUCCEEDED" in out.stdout
    assert sacct_state(bed, job_id(bed, "demo")) == "COMPLETED"
    assert_nothing_outlives_the_job(bed)
    run = tmp_path / "run"
    assert metrics_steps(run)[-3:] == [1, 2, 3]
    for agent in ("llama", "qwen3"):
        assert (run / "final" / agent / "config.json").exists()
        assert list((run / "final" / agent).glob("*.safetensors"))
    assert "[hacrl] 2 Ray node(s) ready at 127.0.0.2:" in logs
    assert "command exited with status 0" in logs
    watch.check_loopback_only()
    assert not list((tmp_path / "jobs").rglob("ray_auth_token*")) and not list((tmp_path / "jobs").rglob("ray_head*"))


@pytest.mark.timeout(2400)
def test_megatron_ranks_on_both_slurm_nodes(bed, tmp_path):
    """A Megatron agent as two Ray ranks (DP2); each Ray node offers one CPU, so one rank per node."""
    with Watch(bed) as watch:
        out = launch(bed, tmp_path, "dp2", overrides=["train.steps=2", "agents.0.workers=ray",
                                                       "agents.0.parallel.dp=2"])
    logs = job_logs(tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + logs[-6000:]
    assert sacct_state(bed, job_id(bed, "dp2")) == "COMPLETED"
    assert_nothing_outlives_the_job(bed)
    assert metrics_steps(tmp_path / "run")[-2:] == [1, 2]
    # the agent's rank actors, one per Slurm node (Ray's own dashboard and runtime-env agents aside)
    ranks = [where for actor, where in watch.actor_nodes.items() if actor.startswith("ray::RankWorker")]
    assert set().union(*ranks) == {"n1", "n2"}, watch.actor_nodes
    watch.check_loopback_only()


@pytest.mark.timeout(1200)
def test_failing_command_fails_the_job(bed, tmp_path):
    """The head's command exits 2 (a bad value found only in the job: --no-validate): the job is FAILED
    with that exit code, hacrl launch says so and exits 1."""
    out = launch(bed, tmp_path, "bad", "--no-validate", overrides=["train.steps=-1"])
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "ended in state FAILED" in out.stderr
    jid = job_id(bed, "bad")
    assert sacct_state(bed, jid) == "FAILED"
    code = subprocess.run(["sacct", "-n", "-X", "-P", "-j", jid, "-o", "ExitCode"], capture_output=True, text=True,
                          env=bed.env()).stdout.strip()
    assert code == "2:0"
    assert "command exited with status 2" in job_logs(tmp_path)


@pytest.mark.timeout(2400)
def test_scancel_mid_run_leaves_a_resumable_run(bed, tmp_path):
    out = launch(bed, tmp_path, "cut", overrides=["train.steps=500", "checkpoint.every=1"], detach=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    jid = job_id(bed, "cut")
    run = tmp_path / "run"
    wait_for("a checkpoint of step 2", lambda: checkpointed(run) >= 2, 1500)
    subprocess.run(["scancel", jid], env=bed.env(), check=True)
    assert sacct_state(bed, jid, timeout_s=120) == "CANCELLED"
    wait_for("every process of the job gone", lambda: not bed.leftovers(), 120)
    last = find_resume_checkpoint(run / "checkpoints")
    assert last is not None and not list(run.rglob(".tmp-*"))
    assert not list((tmp_path / "jobs").rglob("ray_auth_token*")) and not list((tmp_path / "jobs").rglob("ray_head*"))


@pytest.mark.timeout(3000)
def test_requeued_job_resumes_from_its_last_checkpoint(bed, tmp_path):
    steps = 12
    out = launch(bed, tmp_path, "rq", "--requeue", overrides=[f"train.steps={steps}", "checkpoint.every=1",
                                                             "checkpoint.resume=true"], detach=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    jid = job_id(bed, "rq")
    run = tmp_path / "run"
    wait_for("a checkpoint of step 2", lambda: checkpointed(run) >= 2, 1500)
    subprocess.run(["scontrol", "requeue", jid], env=bed.env(), check=True)
    assert sacct_state(bed, jid, timeout_s=1800) == "COMPLETED"
    logs = job_logs(tmp_path)
    restarted = [p for p in (tmp_path / "jobs").rglob("log-*_1.out")]  # SLURM_RESTART_COUNT=1's task log
    assert restarted, logs[-4000:]
    assert "resumed from step" in restarted[0].read_text(errors="replace"), restarted[0].read_text()[-4000:]
    steps_seen = metrics_steps(run)
    assert steps_seen[-1] == steps and len(steps_seen) < 2 * steps  # continued, not restarted from 0
    assert (run / "final" / "llama" / "config.json").exists()


@pytest.mark.timeout(2400)
def test_per_agent_jobs_train_as_two_slurm_jobs_meeting_through_a_shared_folder(bed, tmp_path):
    """`hacrl launch --per-agent-jobs`: one Slurm job per agent, each on one node, at once; the jobs meet
    only through the exchange folder (the bed's nodes share this machine's filesystem, as a cluster's
    share NFS or Lustre) and each trains its agent with the other's responses."""
    out = launch(bed, tmp_path, "sep", "--nodes", "1", "--per-agent-jobs",
                 overrides=["train.steps=2", "exchange.backend=shared_dir", f"exchange.dir={tmp_path / 'exchange'}",
                            "exchange.wait_s=900"])
    logs = job_logs(tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + logs[-6000:]
    for agent in ("llama", "qwen3"):
        assert f"sep-{agent} SUCCEEDED" in out.stdout
        assert f"hacrl launch: agent '{agent}': exit 0" in out.stderr
        assert sacct_state(bed, job_id(bed, f"sep-{agent}")) == "COMPLETED"
        run = tmp_path / "run" / agent
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        assert [r[f"{agent}/exchange/peers_missing"] for r in rows if "step" in r and r["step"] > 0] == [0.0, 0.0]
        other = "qwen3" if agent == "llama" else "llama"
        assert (run / "final" / agent / "config.json").exists() and not (run / "final" / other).exists()
    assert_nothing_outlives_the_job(bed)
