"""Keeps an engine server from outliving the process that started it (the trainer, or a Ray actor).

Servers run in their own session (so that stopping one ends exactly its processes), which also means
nothing ends them when the trainer dies: a ``kill -9`` of the trainer would leave every server up,
holding its port and its GPUs (or gigabytes of CPU memory) for the next job. Each server is therefore
started through this small launcher::

    python -I server_guard.py --parent <trainer pid> --grace <s> -- <server command ...>

The guard is the leader of the server's session and process group and runs the server as its child:

- **parent death**: every :data:`POLL_S` seconds it compares its parent pid with ``--parent``; once
  the trainer is gone (the guard was re-parented) it sends SIGTERM to its whole process group (the
  server and every worker the server forked), waits ``--grace`` seconds, and SIGKILLs the group,
  itself included. The trainer cannot use ``PR_SET_PDEATHSIG`` for this itself: that signal fires
  when the *thread* that forked the child exits, and servers are started from short-lived threads
  (``servers.start_all``, the engine pool's restarts);
- **guard death**: the server runs with ``PR_SET_PDEATHSIG = SIGKILL`` towards the guard (forked from
  the guard's only thread), so a guard killed outright takes the server's main process with it;
- **server exit**: when the server's main process ends, the guard SIGKILLs what is left of its group
  (vLLM's engine-core and worker processes outlive an api_server killed by pid) and exits with the
  server's exit code (a signal ``s`` as ``128 + s``), so the starter still sees how the server ended;
- SIGTERM to the group (``stop()``) reaches the server directly; the guard then waits for it as above.

Standard library only and run with ``python -I`` by path: it imports nothing of the package (whose
``rollout/types.py`` would otherwise shadow the standard ``types``) and starts in milliseconds.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.25  # how often the guard checks its parent and the server (seconds)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with(guard: int) -> None:
    """preexec_fn of the server: SIGKILL when the guard dies (Linux; elsewhere the polling guard alone)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != guard:  # the guard died before the signal was armed
            os._exit(1)


def group_members(pgid: int) -> list[int]:
    """Pids in process group ``pgid`` other than this process, read from ``/proc`` ([] without it)."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def kill_rest(pgid: int) -> None:
    """SIGKILL every other member of ``pgid`` (the server's leftovers)."""
    for pid in group_members(pgid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def end_group(server: subprocess.Popen, grace: float) -> None:
    """The trainer is gone: SIGTERM the group, SIGKILL it (this guard too) after ``grace`` seconds."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the guard outlives its own SIGTERM to wait the grace
    pgid = os.getpgrp()
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (server.poll() is None or group_members(pgid)):
        time.sleep(POLL_S)
    os.killpg(pgid, signal.SIGKILL)


def exit_code(returncode: int) -> int:
    """The server's exit status as a shell reports it (killed by signal s: 128 + s)."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parent", type=int, required=True, help="pid whose death ends the server")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server's command line")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no server command after --")
    if os.getppid() != args.parent:  # the trainer died before the guard got here
        return 1
    # the group's SIGTERM (stop()) reaches the server itself; the guard keeps waiting for it
    signal.signal(signal.SIGTERM, lambda *_: None)
    guard = os.getpid()
    server = subprocess.Popen(command, preexec_fn=lambda: _die_with(guard))
    while server.poll() is None:
        if os.getppid() != args.parent:
            end_group(server, args.grace)
        time.sleep(POLL_S)
    kill_rest(os.getpgrp())
    return exit_code(server.returncode)


if __name__ == "__main__":
    sys.exit(main())
