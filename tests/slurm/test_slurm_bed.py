"""The test bed itself: two Slurm nodes on their own loopback addresses, jobs run on both, sacct
answers, and every daemon listens on a loopback address only."""

from __future__ import annotations

import subprocess
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

NODE_PROBE = ('echo "$SLURM_NODEID $SLURMD_NODENAME $(hostname) '
              '$(scontrol show node "$SLURMD_NODENAME" | grep -o "NodeAddr=[^ ]*")"')


def sacct_state(bed, job_id: str, timeout_s: float = 60.0) -> str:
    """The job's state in the accounting database once it is final (the record lags the job)."""
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                             text=True, env=bed.env())
        state = (out.stdout.split() or [""])[0]  # "CANCELLED by 0" -> CANCELLED
        if state and state not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
            return state
        time.sleep(1)
    return state


def test_one_task_on_each_node_with_its_own_address(bed):
    out = subprocess.run(["srun", "-N2", "-n2", "--label", "bash", "-c", NODE_PROBE], capture_output=True,
                         text=True, env=bed.env(), timeout=120)
    assert out.returncode == 0, out.stderr
    lines = sorted(line.split(": ", 1)[1] for line in out.stdout.splitlines())
    assert lines == ["0 n1 n1 NodeAddr=127.0.0.2", "1 n2 n2 NodeAddr=127.0.0.3"]


def test_batch_job_writes_its_output_and_is_accounted(bed, tmp_path):
    out_file = tmp_path / "job.out"
    sub = subprocess.run(["sbatch", "--parsable", "-N2", f"--output={out_file}", "--wrap",
                          "srun hostname | sort | tr '\\n' ' '"], capture_output=True, text=True, env=bed.env())
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    assert sacct_state(bed, job) == "COMPLETED"
    assert out_file.read_text().strip() == "n1 n2"


def listening(pid: int) -> set[tuple[str, int]]:
    psutil = pytest.importorskip("psutil")
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def test_controller_and_database_listen_on_loopback_only(bed):
    for name, port in (("slurmctld", bed.ctld_port), ("slurmdbd", bed.dbd_port), ("mariadbd", bed.db_port)):
        addrs = listening(bed.procs[name].pid)
        assert ("127.0.0.1", port) in addrs and all(ip.startswith("127.") for ip, _ in addrs), (name, addrs)
    for node in ("n1", "n2"):  # the wildcard address (see tools/slurm_testbed.py), on the node's own port
        assert {p for _, p in listening(bed.procs[f"slurmd-{node}"].pid)} == {bed.node_ports[node]}
