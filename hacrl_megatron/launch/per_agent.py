"""``hacrl launch --per-agent-jobs``: one job per agent of a multi-agent config, meeting through the
rollout exchange (``hacrl train --agent NAME``, docs/exchange.md).

Each agent's job is the ``hacrl launch --agent NAME`` of the same arguments, with the agent's own
experiment name (``<name>-<agent>``), output folder (``<output_dir>/<agent>``, ``checkpoint.dir``
likewise when set) and, on Slurm with ``--gpus-per-node``, the fewest nodes (at most ``--nodes``) its
trainer and engines fit on alone (:func:`~hacrl_megatron.launch.placement.fewest_nodes`), its Ray head
on ``--ray-port`` + its index (two jobs placed on one node do not clash). The jobs are
launched at once, as child processes of this one, and waited for; when one fails, the others are
stopped (their peers would wait for it) and the exit status is the worst of them.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

from hacrl_megatron.config import ExperimentConfig

# (Namespace attribute, its flag, kind): every option of `hacrl launch` a child job repeats as it was given
OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("preset", "--preset", "value"), ("executor", "--executor", "value"), ("job", "--job", "value"),
    ("base_dir", "--base-dir", "value"), ("detach", "--detach", "flag"), ("dryrun", "--dryrun", "flag"),
    ("tail_logs", "--tail-logs", "flag"), ("no_validate", "--no-validate", "flag"), ("env", "--env", "pairs"),
    ("account", "--account", "value"), ("partition", "--partition", "value"),
    ("gpus_per_node", "--gpus-per-node", "value"), ("cpus_per_task", "--cpus-per-task", "value"),
    ("time", "--time", "value"), ("container_image", "--container-image", "value"), ("mount", "--mount", "list"),
    ("job_dir", "--job-dir", "value"), ("ssh_host", "--ssh-host", "value"), ("ssh_user", "--ssh-user", "value"),
    ("packager", "--packager", "value"), ("mem", "--mem", "value"), ("requeue", "--requeue", "flag"),
    ("socket_ifname", "--socket-ifname", "value"), ("ray_port", "--ray-port", "value"),
    ("ray_wait_timeout", "--ray-wait-timeout", "value"),
)


def launch_argv(args: argparse.Namespace) -> list[str]:
    """The `hacrl launch` arguments that give ``args`` back (without --name, --nodes, --agent,
    --per-agent-jobs and the overrides, which each agent's job sets itself)."""
    out: list[str] = []
    for dest, flag, kind in OPTIONS:
        value = getattr(args, dest)
        if kind == "flag":
            out += [flag] if value else []
        elif kind == "list":
            out += [part for item in value for part in (flag, item)]
        elif kind == "pairs":
            out += [part for key, val in value for part in (flag, f"{key}={val}")]
        elif value is not None:
            out += [flag, str(value)]
    return out


def agent_jobs(args: argparse.Namespace, cfg: ExperimentConfig) -> list[tuple[str, list[str]]]:
    """(agent, its `hacrl launch` arguments) for every agent of ``cfg``."""
    from hacrl_megatron.launch.placement import fewest_nodes, job_config

    jobs = []
    for index, agent in enumerate(cfg.agents):
        nodes = args.nodes
        if args.executor == "slurm" and args.gpus_per_node:
            nodes = fewest_nodes(job_config(cfg, agent.name), args.nodes, args.gpus_per_node)
        folders = [f"output_dir={cfg.output_dir.rstrip('/')}/{agent.name}"]
        if cfg.checkpoint.dir:
            folders.append(f"checkpoint.dir={cfg.checkpoint.dir.rstrip('/')}/{agent.name}")
        # each job's Ray head on its own port: two jobs the scheduler puts on one node must not clash
        jobs.append((agent.name, [*launch_argv(args), "--name", f"{args.name}-{agent.name}", "--nodes", str(nodes),
                                  "--ray-port", str(args.ray_port + index), "--agent", agent.name, *args.overrides,
                                  *folders]))
    return jobs


def run_agent_jobs(jobs: list[tuple[str, list[str]]], command: list[str] | None = None, poll_s: float = 0.5) -> int:
    """Launch every job at once (``command`` + its arguments; default ``python -m hacrl_megatron launch``)
    and wait for all; when one fails the others are stopped. Returns the worst exit status (2 over 1 over 0)."""
    label = "hacrl launch" if command is None else " ".join(command)
    command = command or [sys.executable, "-m", "hacrl_megatron", "launch"]
    procs: dict[str, Any] = {}
    for agent, argv in jobs:
        print(f"hacrl launch: agent {agent!r}: {label} {' '.join(argv)}", file=sys.stderr)
        procs[agent] = subprocess.Popen([*command, *argv], start_new_session=True)
    codes: dict[str, int] = {}
    try:
        while len(codes) < len(procs):
            for agent, proc in procs.items():
                if agent not in codes and proc.poll() is not None:
                    codes[agent] = proc.returncode
                    if proc.returncode != 0:
                        _stop_others(procs, codes, agent)
            time.sleep(poll_s)
    finally:
        _stop_others(procs, codes, None)
    for agent, code in codes.items():
        print(f"hacrl launch: agent {agent!r}: exit {code}", file=sys.stderr)
    bad = [c for c in codes.values() if c != 0]
    return 0 if not bad else 2 if 2 in bad else 1  # a job killed by a signal has a negative code: 1


def _stop_others(procs: dict[str, Any], codes: dict[str, int], failed: str | None) -> None:
    """SIGTERM the jobs still running (their whole process group), then SIGKILL after 30 s."""
    running = {a: p for a, p in procs.items() if a not in codes and p.poll() is None}
    if failed is not None and running:
        print(f"hacrl launch: agent {failed!r}'s job failed: stopping {sorted(running)}", file=sys.stderr)
    for proc in running.values():
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for agent, proc in running.items():
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        codes.setdefault(agent, proc.returncode)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
