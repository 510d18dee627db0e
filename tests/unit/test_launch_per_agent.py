"""`hacrl launch --agent NAME` and `--per-agent-jobs` (launch/per_agent.py, docs/exchange.md): one job per
agent, each `hacrl train --agent NAME` in its own output folder, sized for its agent alone; the jobs run
at once and a failed one stops the others."""

from __future__ import annotations

import argparse
import glob
import sys
import time
from pathlib import Path

import pytest

from hacrl_megatron.config import load_config
from hacrl_megatron.launch import cli
from hacrl_megatron.launch.per_agent import agent_jobs, launch_argv, run_agent_jobs

nemo_run = pytest.importorskip("nemo_run")

EXCHANGE = ("exchange.backend=shared_dir", "exchange.dir=/shared/ex")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


def test_launch_argv_gives_the_same_options_back():
    argv = ["--preset", "cpu_demo", "--executor", "slurm", "--job", "train", "--base-dir", "/b", "--detach",
            "--no-validate", "--env", "A=1", "--env", "B=x=y", "--account", "acc", "--partition", "gpu",
            "--gpus-per-node", "4", "--cpus-per-task", "16", "--time", "01:00:00", "--container-image", "img:1",
            "--mount", "/a:/a", "--mount", "/b:/b", "--job-dir", "/jobs", "--ssh-host", "login", "--ssh-user", "me",
            "--packager", "none", "--mem", "200G", "--requeue", "--socket-ifname", "ib0", "--ray-port", "7000",
            "--ray-wait-timeout", "60", "--name", "n", "--nodes", "3", "--per-agent-jobs", "train.steps=2"]
    args = parse(argv)
    again = parse([*launch_argv(args), "--name", "n", "--nodes", "3", "--per-agent-jobs", "train.steps=2"])
    assert "--ray-port" in launch_argv(args)  # a job's own --ray-port (agent_jobs) comes after it and wins
    assert vars(again) == vars(args)


def test_each_job_trains_its_agent_in_its_own_folder_on_the_fewest_nodes():
    args = parse(["--preset", "gpu_qwen3_30b_a3b_llama8b", "--executor", "slurm", "--account", "acc", "--nodes", "4",
                  "--gpus-per-node", "8", "--name", "sep", "--per-agent-jobs", *EXCHANGE])
    cfg = load_config(args.preset, args.overrides)
    jobs = dict(agent_jobs(args, cfg))
    assert list(jobs) == ["qwen3_30b_a3b", "llama8b_instruct"]
    for agent, argv in jobs.items():
        back = parse(argv)
        assert back.agent == agent and back.name == f"sep-{agent}" and not back.per_agent_jobs
        assert back.overrides == [*EXCHANGE, f"output_dir={cfg.output_dir}/{agent}"]
        assert back.nodes == 1  # each agent's trainer and engine fit one 8-GPU node alone (the pair needs 4)
        assert back.ray_port == 6379 + [a.name for a in cfg.agents].index(agent)  # heads that share a node
    # CPU nodes (no --gpus-per-node): every job gets --nodes
    args = parse(["--executor", "slurm", "--account", "acc", "--nodes", "2", "--per-agent-jobs", *EXCHANGE,
                  "checkpoint.dir=/ckpt"])
    for agent, argv in agent_jobs(args, load_config(args.preset, args.overrides)):
        back = parse(argv)
        assert back.nodes == 2 and back.overrides[-1] == f"checkpoint.dir=/ckpt/{agent}"


def test_per_agent_dryrun_writes_one_job_per_agent(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    code = cli.main(parse(["--executor", "slurm", "--account", "acc", "--nodes", "1", "--container-image", "none",
                           "--packager", "none", "--dryrun", "--base-dir", str(tmp_path), "--name", "sep",
                           "--per-agent-jobs", *EXCHANGE]))
    assert code == 0
    for agent in ("llama", "qwen3"):
        (script,) = glob.glob(str(tmp_path / "experiments" / f"sep-{agent}" / "*" / f"sep-{agent}" / "scripts" / "*.sh"))
        text = open(script).read()
        assert (f"python -m hacrl_megatron train --preset cpu_demo --agent {agent} {' '.join(EXCHANGE)} "
                f"output_dir=runs/cpu_demo/{agent}") in text


@pytest.mark.parametrize("argv, message", [
    (["--per-agent-jobs"], "hacrl launch: --agent runs one agent of the run in this process; its peers run as other "
                           "jobs, which the local exchange cannot reach"),
    (["--agent", "mistral", *EXCHANGE], "hacrl launch: --agent 'mistral': no such agent in this config; its agents "
                                        "are ['llama', 'qwen3']"),
    (["--agent", "llama", "--job", "pretrain", *EXCHANGE], "hacrl launch: --agent runs hacrl train --agent; not --job "
                                                           "pretrain"),
    (["--agent", "llama", "--per-agent-jobs", *EXCHANGE], "hacrl launch: --agent and --per-agent-jobs: give one"),
    (["--per-agent-jobs", "--no-validate", *EXCHANGE], "hacrl launch: --per-agent-jobs needs the config here"),
])
def test_wrong_agent_options_are_one_line_and_exit_2(argv, message, capsys):
    assert cli.main(parse(argv)) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(message)


def test_a_failed_job_stops_the_others(tmp_path):
    """The first job fails at once; the second (which would wait for its peer's records) is stopped."""
    marker, ready = tmp_path / "stopped", tmp_path / "ready"
    sleeper = (f"import signal, sys, time\n"
               f"def stop(*_):\n    open({str(marker)!r}, 'w').write('TERM')\n    sys.exit(143)\n"
               f"signal.signal(signal.SIGTERM, stop)\nopen({str(ready)!r}, 'w').close()\ntime.sleep(120)\n")
    # the failing job fails once the other one is up (its SIGTERM handler set), as a real peer would be
    failing = (f"import os, sys, time\nwhile not os.path.exists({str(ready)!r}):\n    time.sleep(0.02)\n"
               f"sys.exit(1)\n")
    started = time.monotonic()
    code = run_agent_jobs([("a", ["-c", failing]), ("b", ["-c", sleeper])], command=[sys.executable], poll_s=0.05)
    assert code == 1 and marker.read_text() == "TERM"
    assert time.monotonic() - started < 60
    # all succeed: 0; a bad argument (exit 2) wins over a failure
    assert run_agent_jobs([("a", ["-c", "pass"]), ("b", ["-c", "pass"])], command=[sys.executable], poll_s=0.05) == 0
    # a job refused at once (exit 2) makes the whole launch exit 2, the other stopped by it
    assert run_agent_jobs([("a", ["-c", "import sys; sys.exit(2)"]),
                           ("b", ["-c", "import sys, time; time.sleep(30); sys.exit(1)"])],
                          command=[sys.executable], poll_s=0.05) == 2
