"""The Ray-on-Slurm node script, executed for real on this machine without Slurm.

Node 0 (no SLURM_* variables: one node) starts a Ray head, waits for the nodes, runs the command
with RAY_ADDRESS set, stops *its own* Ray node and exits with the command's status. The slow test
also runs a worker "node" next to the head (separate temp dirs and ports) and checks that it
joins the cluster and exits 0 once the head is gone. Every Ray process is started with a private
--temp-dir, free ports and its own auth token, so nothing here touches other Ray instances on the
machine, and the test checks that no process of its temp dir survives.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("ray")

from hacrl_megatron.launch import slurm_ray  # noqa: E402
from hacrl_megatron.launch.executors import PACKAGE_ROOT  # noqa: E402
from hacrl_megatron.launch.slurm_ray import ray_cluster_script  # noqa: E402
from hacrl_megatron.models.parallel import free_port  # noqa: E402

PROBE = ("import os, ray; ray.init(); n = len([x for x in ray.nodes() if x['Alive']]); "
         "print('ADDR', os.environ['RAY_ADDRESS'], 'NODES', n); raise SystemExit(n + 1)")


def _node_args(name: str) -> tuple[str, str]:
    """(per-node `ray start` flags, temp dir): own temp dir, every default port replaced by a free one."""
    flags = ["ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
             "metrics-export-port", "runtime-env-agent-port", "node-manager-port", "object-manager-port"]
    # the Unix socket paths under --temp-dir must stay short (107 bytes)
    temp = f"/tmp/hr_{uuid.uuid4().hex[:8]}_{name}"
    return " ".join([f"--temp-dir={temp}", "--num-cpus=1"] + [f"--{f}={free_port()}" for f in flags]), temp


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RAY_", "HACRL_RAY"))}
    env.update(PYTHONPATH=PACKAGE_ROOT, RAY_AUTH_MODE="token", **extra)
    return env


def _survivors(temp: str) -> list[int]:
    """PIDs of that node's Ray processes: their command line mentions ``temp``, or they hold a file under it
    (a Ray agent that sets its process title can overwrite what /proc shows of its command line; its open
    log files still name the node's folder)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if temp.encode() in f.read():
                    pids.append(int(pid))
                    continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(temp):
                    pids.append(int(pid))
                    break
            except OSError:
                continue
    return pids


def test_head_node_runs_command_and_returns_its_status(tmp_path):
    port = free_port()
    args, temp = _node_args("h")
    script = tmp_path / "node.sh"
    script.write_text(ray_cluster_script([sys.executable, "-c", PROBE], python=sys.executable, port=port,
                                         wait_timeout_s=120))
    env = _env(RAY_AUTH_TOKEN=uuid.uuid4().hex, HACRL_RAY_START_ARGS=args)
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]  # 1 node + 1: the command's status
    assert f":{port} NODES 1" in out.stdout
    assert "command exited with status 2; stopping Ray" in out.stdout
    time.sleep(1.0)
    assert _survivors(temp) == []


def test_a_head_that_dies_while_starting_fails_the_job_at_once_not_after_the_wait(tmp_path):
    """`ray start --head` exiting before its port opens (here a bad flag; on a cluster a taken port) ends the
    node script with one line naming it, long before the 600 s wait for the nodes would."""
    script = tmp_path / "node.sh"
    script.write_text(ray_cluster_script([sys.executable, "-c", "raise SystemExit(0)"], python=sys.executable,
                                         port=free_port(), wait_timeout_s=600))
    temp = f"/tmp/hr_{uuid.uuid4().hex[:8]}_d"
    env = _env(RAY_AUTH_TOKEN=uuid.uuid4().hex, HACRL_RAY_START_ARGS=f"--temp-dir={temp} --num-cpus=not-a-number")
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert time.monotonic() - t0 < 300
    assert re.search(r"the Ray head \(`ray start --head`, pid \d+\) exited before 127\.0\.0\.1:\d+ opened", out.stderr), \
        out.stderr[-3000:]
    assert "command exited" not in out.stdout  # the command never ran


def test_process_running_counts_an_unreaped_child_as_exited():
    assert slurm_ray.process_running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while slurm_ray.process_running(child.pid):  # a zombie until reaped below
        assert time.monotonic() < deadline, "the child never showed as exited"
        time.sleep(0.05)
    assert os.path.exists(f"/proc/{child.pid}")  # still there, unreaped: the zombie case
    child.wait()
    assert not slurm_ray.process_running(child.pid)


@pytest.mark.slow
def test_worker_node_joins_and_leaves_when_the_head_is_done(tmp_path):
    port = free_port()
    script = tmp_path / "node.sh"
    script.write_text(ray_cluster_script([sys.executable, "-c", PROBE], python=sys.executable, port=port,
                                         wait_timeout_s=180))
    token = uuid.uuid4().hex
    (head_args, head_temp), (worker_args, worker_temp) = _node_args("h"), _node_args("w")
    common = dict(RAY_AUTH_TOKEN=token, SLURM_NNODES="2")
    # two "nodes" on their own loopback addresses (HACRL_RAY_NODE_IP: no Slurm to ask); the worker is
    # told the head's address
    head = subprocess.Popen(["bash", str(script)], env=_env(SLURM_NODEID="0", HACRL_RAY_START_ARGS=head_args,
                                                            HACRL_RAY_NODE_IP="127.0.0.2", **common),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    worker = subprocess.Popen(["bash", str(script)], env=_env(SLURM_NODEID="1", HACRL_RAY_HEAD_IP="127.0.0.2",
                                                              HACRL_RAY_NODE_IP="127.0.0.3",
                                                              HACRL_RAY_START_ARGS=worker_args, **common),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        head_out, _ = head.communicate(timeout=300)
        worker_out, _ = worker.communicate(timeout=120)
    finally:
        for p in (head, worker):
            if p.poll() is None:
                p.kill()
    assert head.returncode == 3, head_out[-3000:]  # both nodes alive when the command ran
    assert "NODES 2" in head_out
    assert worker.returncode == 0, worker_out[-3000:]
    time.sleep(1.0)
    assert _survivors(head_temp) == [] and _survivors(worker_temp) == []


class _FlakyRay:
    """A stand-in `ray` whose init fails ``fails`` times the way a head does whose GCS port is open but whose
    own node has not registered yet."""

    def __init__(self, fails: int):
        self.fails, self.inits, self.shutdowns = fails, 0, 0

    def init(self, address, log_to_driver):
        self.inits += 1
        if self.inits <= self.fails:
            raise ConnectionError(f"Failed to connect to Ray cluster at {address}")

    def nodes(self):
        return [{"Alive": True}, {"Alive": True}]

    def shutdown(self):
        self.shutdowns += 1


def test_wait_for_nodes_retries_while_the_heads_node_registers_and_stops_if_the_head_dies(monkeypatch):
    import hacrl_megatron.agents.ray_placement as placement

    monkeypatch.setattr(slurm_ray, "_port_open", lambda host, port: True)
    monkeypatch.setattr(slurm_ray.time, "sleep", lambda s: None)
    fake = _FlakyRay(fails=3)
    monkeypatch.setattr(placement, "require_ray", lambda: fake)
    assert slurm_ray.wait_for_nodes("127.0.0.1:6379", 2, timeout_s=60, head_pid=os.getpid()) == 2
    assert fake.inits == 4 and fake.shutdowns == 3 + 1  # each failed init undone, and the last one's shutdown

    fake = _FlakyRay(fails=10**9)
    monkeypatch.setattr(placement, "require_ray", lambda: fake)
    monkeypatch.setattr(slurm_ray, "process_running", lambda pid: fake.inits < 5)
    with pytest.raises(RuntimeError, match=r"the Ray head \(`ray start --head`, pid 4242\) exited while starting"):
        slurm_ray.wait_for_nodes("127.0.0.1:6379", 2, timeout_s=60, head_pid=4242)
    assert fake.inits == 5
