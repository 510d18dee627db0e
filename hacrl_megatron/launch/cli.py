"""``hacrl launch``: run a hacrl job through NeMo-Run on this machine, a Slurm cluster or Docker.

    hacrl launch [--preset P] [overrides ...]                                   # local subprocess
    hacrl launch --executor slurm --account A --partition P --nodes 2 --gpus-per-node 8 \\
                 --container-image IMG --preset paper_qwen3_4b_with_instruct train.steps=200
    hacrl launch --executor docker --preset ... --detach
    hacrl launch --executor slurm ... --per-agent-jobs exchange.backend=redis exchange.redis_url=...  # a job per agent

Container image (docker and slurm): ``--container-image``, else ``$HACRL_IMAGE``, else
``hacrl-megatron:<package version>``, the tag the top-level Dockerfile is built with (docs/clusters.md,
"The container image"); ``--container-image none`` runs a Slurm job on the nodes' own Python environment, and
``--container-image /shared/images/hacrl.sqsh`` (an absolute path ending in .sqsh) runs it from a
squashfs file on the shared filesystem. Slurm jobs take all of each node's memory (``--mem 0``), are
not requeued unless ``--requeue`` is given (accepted only with ``checkpoint.resume=true``: a restarted
job must resume, not start over), and ``--socket-ifname IFACE`` sets NCCL's and gloo's interface.
The configuration is resolved and validated here first, so a typo fails before anything is
submitted. Exit status: 0 when the job succeeded (or, with --detach/--dryrun, was submitted/written),
1 when it failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from hacrl_megatron import __version__
from hacrl_megatron.config import load_config
from hacrl_megatron.launch import executors
from hacrl_megatron.launch.recipes import SUBCOMMANDS, LaunchError, launch_train

EXECUTORS = ("local", "slurm", "docker")
IMAGE_ENV = "HACRL_IMAGE"  # overrides the default image, e.g. registry.example.com/hacrl/hacrl-megatron:0.1.0
IMAGE_NAME = "hacrl-megatron"
NO_IMAGE = "none"


def default_image() -> str:
    """``$HACRL_IMAGE``, else ``hacrl-megatron:<package version>`` (docs/clusters.md: build and tag)."""
    return os.environ.get(IMAGE_ENV) or f"{IMAGE_NAME}:{__version__}"


def _key_value(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    key, value = text.split("=", 1)
    return key, value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="cpu_demo", help="built-in preset name or YAML path (default cpu_demo)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, as for `hacrl train`")
    p.add_argument("--executor", choices=EXECUTORS, default="local", help="where the job runs (default local)")
    p.add_argument("--job", choices=SUBCOMMANDS, default="train", help="hacrl sub-command to run (default train)")
    p.add_argument("--name", default="hacrl", help="NeMo-Run experiment and task name")
    p.add_argument("--base-dir", default=None, help="NeMo-Run experiment directory (default ~/.nemo_run)")
    p.add_argument("--detach", action="store_true", help="return once submitted (Slurm/Docker)")
    p.add_argument("--dryrun", "--dry-run", action="store_true",
                   help="write the job files (e.g. sbatch script), submit nothing")
    p.add_argument("--tail-logs", action="store_true", help="stream the job's log while waiting")
    p.add_argument("--no-validate", action="store_true",
                   help="skip validating the config here (a preset path that exists only on the cluster)")
    p.add_argument("--env", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
                   help="environment variable of the job (repeatable)")
    p.add_argument("--agent", metavar="NAME",
                   help="the job trains only agent NAME of the config (hacrl train --agent NAME); it meets the other "
                        "agents' jobs through exchange.backend shared_dir or redis (docs/exchange.md)")
    p.add_argument("--per-agent-jobs", action="store_true",
                   help="one job per agent (each as with --agent, named <name>-<agent>, writing to "
                        "<output_dir>/<agent>; on Slurm each on the fewest nodes, at most --nodes, its agent fits "
                        "on alone), launched at once and waited for")
    g = p.add_argument_group("slurm / docker")
    g.add_argument("--account", help="sbatch --account (slurm, required)")
    g.add_argument("--partition", help="sbatch --partition")
    g.add_argument("--nodes", type=int, default=1, help="nodes; each runs one Ray node (slurm)")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (slurm; docker: -1 = all)")
    g.add_argument("--cpus-per-task", type=int, default=None, help="CPUs Ray may use per node (slurm)")
    g.add_argument("--time", default="04:00:00", help="sbatch --time (slurm)")
    g.add_argument("--container-image",
                   help=f"container image (docker; slurm: pyxis image, '{NO_IMAGE}': bare metal); "
                        f"default ${IMAGE_ENV} or {IMAGE_NAME}:<version>")
    g.add_argument("--mount", action="append", default=[], metavar="SRC:DST",
                   help="container mount / docker volume (repeatable)")
    g.add_argument("--job-dir", help="job files directory on the cluster's shared filesystem (slurm; submitting "
                                     "from the login node it is the experiment folder, as --base-dir)")
    g.add_argument("--ssh-host", help="submit over SSH to this login node (slurm; needs --ssh-user, --job-dir)")
    g.add_argument("--ssh-user", help="SSH user (slurm)")
    g.add_argument("--packager", choices=("git", "none"), default="git",
                   help="git: ship the committed checkout; none: the image has hacrl_megatron installed")
    g.add_argument("--mem", default="0", help="sbatch --mem per node (slurm; default 0: all of the node's memory)")
    g.add_argument("--requeue", action="store_true",
                   help="let Slurm requeue the job after a node failure or preemption (slurm; needs "
                        "checkpoint.resume=true so the restarted job resumes)")
    g.add_argument("--socket-ifname", metavar="IFACE",
                   help="NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME on every node (slurm; e.g. ib0; default: "
                        "unset, NCCL's own choice)")
    g.add_argument("--ray-port", type=int, default=6379, help="Ray head port inside the Slurm job")
    g.add_argument("--ray-wait-timeout", type=int, default=600, help="seconds to wait for all Ray nodes (slurm)")


def build_executor(args: argparse.Namespace) -> Any:
    """The NeMo-Run executor named by ``args.executor``; ValueError names a missing argument."""
    env = dict(args.env)
    if args.executor == "local":
        return executors.local_executor(env_vars=env)
    image = args.container_image or default_image()
    if args.executor == "slurm":
        if not args.account:
            raise ValueError("--executor slurm needs --account")
        job = executors.SlurmJob(
            args.account, args.partition, args.nodes, args.gpus_per_node, None if image == NO_IMAGE else image,
            time=args.time, container_mounts=tuple(args.mount), cpus_per_task=args.cpus_per_task,
            job_dir=args.job_dir, ssh_host=args.ssh_host, ssh_user=args.ssh_user, mem=args.mem or None,
            requeue=args.requeue,
        )
        return executors.slurm_executor(job, env_vars=env, packager=args.packager)
    if image == NO_IMAGE:
        raise ValueError(f"--executor docker needs a container image, not --container-image {NO_IMAGE}")
    gpus = -1 if args.gpus_per_node is None else args.gpus_per_node
    return executors.docker_executor(image, num_gpus=gpus, volumes=args.mount, env_vars=env,
                                     packager=args.packager)


def resumes(args: argparse.Namespace) -> bool:
    """The job resumes from its checkpoints: ``checkpoint.resume`` of the resolved config, or (with
    ``--no-validate``) a ``checkpoint.resume=true`` override."""
    if not args.no_validate:
        return load_config(args.preset, args.overrides).checkpoint.resume
    values = [ov.split("=", 1)[1].strip().lower() for ov in args.overrides if ov.split("=", 1)[0] == "checkpoint.resume"]
    return bool(values) and values[-1] == "true"


def _check_slurm_flags(args: argparse.Namespace) -> None:
    """ValueError for Slurm-only flags on another executor and for --requeue without resume."""
    if args.executor != "slurm":
        given = [flag for flag, on in (("--requeue", args.requeue), ("--socket-ifname", args.socket_ifname)) if on]
        if given:
            raise ValueError(f"{' and '.join(given)}: Slurm options (--executor slurm)")
        return
    if args.job_dir and args.base_dir and not (args.ssh_host or args.dryrun) and \
            os.path.abspath(args.job_dir) != os.path.abspath(args.base_dir):
        raise ValueError("--job-dir and --base-dir: a Slurm job submitted from this machine keeps its files in one "
                         "folder (<folder>/experiments/<name>/<id>); give one of them")
    if args.requeue and not resumes(args):
        raise ValueError("--requeue needs checkpoint.resume=true: Slurm restarts a requeued job from the start, and "
                         "without resume it would train from scratch (or be refused its own run folder)")


def _check_agent_flags(args: argparse.Namespace, cfg: Any) -> None:
    """ValueError for --agent / --per-agent-jobs that cannot work: an unknown agent, another job than train,
    a local exchange (the jobs could not meet), or both flags at once."""
    from hacrl_megatron.config.agent_jobs import agent_index, check_exchange_config

    if args.agent and args.per_agent_jobs:
        raise ValueError("--agent and --per-agent-jobs: give one (--per-agent-jobs launches every agent's --agent job)")
    if (args.agent or args.per_agent_jobs) and args.job != "train":
        raise ValueError(f"--{'agent' if args.agent else 'per-agent-jobs'} runs hacrl train --agent; not --job {args.job}")
    if cfg is None:
        return  # --no-validate: the job checks its config on the cluster
    if args.agent:
        agent_index(cfg, args.agent)
    if args.agent or args.per_agent_jobs:
        if len(cfg.agents) < 2:
            raise ValueError("--per-agent-jobs: this config has one agent; launch it without --per-agent-jobs")
        check_exchange_config(cfg)


def main(args: argparse.Namespace) -> int:
    from hacrl_megatron.errors import InputError

    cfg = None if args.no_validate else load_config(args.preset, args.overrides)  # ConfigError: exit 2
    try:
        _check_slurm_flags(args)
        _check_agent_flags(args, cfg)
        if args.per_agent_jobs:
            from hacrl_megatron.launch.per_agent import agent_jobs, run_agent_jobs

            if cfg is None:
                raise ValueError("--per-agent-jobs needs the config here (its agents name the jobs): drop --no-validate")
            from hacrl_megatron.launch.executors import require_nemo_run

            require_nemo_run()  # every agent's job launches through NeMo-Run: none starts when it is missing
            return run_agent_jobs(agent_jobs(args, cfg))
        executor = build_executor(args)
    except (ValueError, ImportError, InputError) as err:
        print(f"hacrl launch: {err}", file=sys.stderr)
        return 2
    ray_script = {"port": args.ray_port, "wait_timeout_s": args.ray_wait_timeout,
                  "socket_ifname": args.socket_ifname} if args.executor == "slurm" else {}
    try:
        result = launch_train(args.preset, args.overrides, executor, args.name, subcommand=args.job,
                              base_dir=args.base_dir, detach=args.detach, tail_logs=args.tail_logs,
                              dryrun=args.dryrun, agent=args.agent, **ray_script)
    except LaunchError as err:
        print(f"hacrl launch: {err}", file=sys.stderr)
        return 1
    print(f"hacrl launch: {result.name} {result.state} (experiment {result.experiment_id}); "
          f"files: {result.job_dir}" + (f"; log: {result.log_path}" if result.log_path else ""))
    return 0
