"""The real two-node Slurm cluster of these tests (tools/slurm_testbed.py), once per session.

Needs root and Debian's ``slurmctld slurmd slurm-client slurmdbd munge mariadb-server``
(``.ci/slurm.sh install``). Without them the tests skip, unless ``HACRL_REQUIRE_SLURM=1`` (CI's
Slurm step), which makes a missing Slurm a failure. After every test no job may be left and no
process of the bed other than its daemons (Ray, slurmstepd, the job's tasks) may still run.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import time

import pytest

bed_module = importlib.import_module("tools.slurm_testbed")


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm test bed runs its daemons as root"
    missing = bed_module.missing_binaries()
    if missing:
        return f"not installed: {', '.join(missing)} (bash .ci/slurm.sh install)"
    return None


def _sigterm_as_ctrl_c(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def slurm_bed(tmp_path_factory):
    why = _unavailable()
    if why:
        if os.environ.get("HACRL_REQUIRE_SLURM") == "1":
            pytest.fail(f"HACRL_REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)
    # SIGTERM (CI stops this step when another step fails first) ends the session like Ctrl-C, so that the
    # teardown below still stops the bed's daemons, which run in sessions of their own
    previous = signal.signal(signal.SIGTERM, _sigterm_as_ctrl_c)
    # HACRL_SLURM_NICE: the jobs' nice value (a machine busy with other work can starve Ray's startup)
    bed = bed_module.SlurmBed(tmp_path_factory.mktemp("slurm"), nice=int(os.environ.get("HACRL_SLURM_NICE", "0")))
    try:
        bed.start()
        yield bed
    finally:
        killed = bed.stop()
        signal.signal(signal.SIGTERM, previous)
        assert killed == [], f"processes of the Slurm test bed were still running after its jobs: {killed}"


@pytest.fixture
def bed(slurm_bed):
    """The session's bed, checked clean after the test: no job queued or running, no bed process left."""
    yield slurm_bed
    deadline = time.monotonic() + 60
    while (slurm_bed.jobs() or slurm_bed.leftovers()) and time.monotonic() < deadline:
        time.sleep(1)
    jobs, left = slurm_bed.jobs(), slurm_bed.leftovers()
    if jobs or left:  # clean up for the next test, then fail this one
        slurm_bed.cancel_all()
        for pid in slurm_bed.leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not jobs and not left, f"after the test: jobs left {jobs}, processes left {describe(left)}"


def describe(pids: list[int]) -> list[str]:
    """``PID command line`` of each process (for messages)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            out.append(f"{pid} {cmdline}")
        except OSError:
            out.append(f"{pid} (gone)")
    return out
