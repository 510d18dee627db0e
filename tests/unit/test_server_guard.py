"""Engine servers die with their starter (rollout/server_guard.py, servers.launch / end_group).

Stand-in "servers" here are tiny Python processes that fork a worker (as vLLM's api_server forks its
engine core) and sleep; the starter is a separate Python process so that it can be killed with -9.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hacrl_megatron.rollout.server_guard import group_members
from hacrl_megatron.rollout.servers import end_group, error_lines, launch
from hacrl_megatron.rollout.vllm_server import VLLMServer, VLLMServerError

ROOT = Path(__file__).resolve().parents[2]

# a server with one worker; IGNORE_TERM=1: both ignore SIGTERM (only SIGKILL ends them)
SERVER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    if os.environ.get("IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("worker", worker.pid, flush=True)
    time.sleep(600)
""")


def live(pgid: int) -> list[int]:
    """Members of ``pgid`` that are not zombies (a zombie holds no memory, port or GPU; the
    container's init may reap it late)."""
    alive = []
    for pid in group_members(pgid):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def wait_gone(pgid: int, within: float) -> float:
    """Seconds until no live process is left in ``pgid``; fails after ``within`` seconds."""
    t0 = time.monotonic()
    while live(pgid):
        assert time.monotonic() - t0 < within, f"processes {live(pgid)} of group {pgid} still run"
        time.sleep(0.1)
    return time.monotonic() - t0


def wait_members(pgid: int, count: int, within: float = 30.0) -> None:
    t0 = time.monotonic()
    while len(live(pgid)) < count:
        assert time.monotonic() - t0 < within, f"group {pgid} has {live(pgid)}, expected {count} processes"
        time.sleep(0.1)


def start_trainer(tmp_path: Path, grace: float, ignore_term: bool) -> tuple[subprocess.Popen, int]:
    """A starter process that launches SERVER guarded and prints the group id; returns (starter, pgid)."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from hacrl_megatron.rollout import servers
        servers.ORPHAN_GRACE_S = {grace}
        log = open({str(tmp_path / "server.log")!r}, "ab")
        proc = servers.subprocess.Popen(servers.guarded([sys.executable, "-c", {SERVER!r}], grace={grace}),
                                        stdout=log, stderr=log, start_new_session=True)
        print(proc.pid, flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "IGNORE_TERM": "1" if ignore_term else "0"}
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    pgid = int(trainer.stdout.readline())
    return trainer, pgid


@pytest.mark.parametrize("ignore_term", [False, True], ids=["sigterm", "sigkill_after_grace"])
def test_kill_9_of_the_starter_ends_the_servers_whole_group(tmp_path, ignore_term):
    trainer, pgid = start_trainer(tmp_path, grace=1.0, ignore_term=ignore_term)
    try:
        wait_members(pgid, 3)  # guard, server, worker
        trainer.kill()
        trainer.wait()
        took = wait_gone(pgid, within=15.0)
        print(f"group gone {took:.1f} s after kill -9 of the starter")
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for pid in live(pgid):
            os.kill(pid, signal.SIGKILL)


def test_a_server_killed_by_pid_takes_its_workers_with_it(tmp_path):
    """The guard ends the leftovers of a server whose main process died (vLLM's engine core)."""
    with (tmp_path / "log").open("ab") as log:
        proc = launch([sys.executable, "-c", SERVER], log)
    try:
        wait_members(proc.pid, 3)
        server = [p for p in live(proc.pid) if p != proc.pid]
        main = min(server)  # the server's main process started before its worker
        os.kill(main, signal.SIGKILL)
        assert proc.wait(timeout=15) == 128 + signal.SIGKILL  # the guard reports how the server ended
        wait_gone(proc.pid, within=10.0)
    finally:
        end_group(proc, grace=1.0)


def test_end_group_ends_the_group_when_its_leader_is_already_dead(tmp_path):
    """stop()/restart() of a server whose main process died: its worker must not survive."""
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, "
                               "'-c', 'import time; time.sleep(600)']); print('ok', flush=True)"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert leader.stdout.readline().strip() == "ok"
    leader.wait(timeout=30)
    assert live(leader.pid), "the orphaned worker should still run before end_group"
    end_group(leader, grace=1.0)
    wait_gone(leader.pid, within=10.0)


def test_stop_ends_a_running_server_and_its_worker(tmp_path):
    server = VLLMServer(None, command=[sys.executable, "-c", SERVER + "\n"], log_path=tmp_path / "s.log")
    with (tmp_path / "s.log").open("ab") as log:
        server.process = launch(server.command_line(), log)
    pgid = server.process.pid
    wait_members(pgid, 3)
    server.stop(grace=5.0)
    wait_gone(pgid, within=10.0)


def test_startup_failure_quotes_the_servers_own_error_not_its_last_line(tmp_path):
    script = ("import sys; print('INFO loading model'); print('AssertionError: expected one core list per rank, got 1'); "
              "print('Traceback tail ...'); print('Exception: See root cause above.'); sys.exit(3)")
    server = VLLMServer(None, command=[sys.executable, "-c", script], log_path=tmp_path / "server.log")
    with pytest.raises(VLLMServerError) as err:
        server.start(timeout=60, interval=0.2)
    message = str(err.value)
    assert "exited with code 3 during start-up" in message
    assert "AssertionError: expected one core list per rank" in message
    assert "INFO loading model" not in message  # error lines, not the whole log
    assert server.process is None


def test_error_lines_fall_back_to_the_last_lines_and_say_when_there_is_no_log(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("\n".join(f"line {i}" for i in range(20)) + "\n")
    assert error_lines(log, count=3) == "line 17\nline 18\nline 19"
    assert "no log at" in error_lines(tmp_path / "missing.log")
