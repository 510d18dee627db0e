"""NeMo-Run recipes: ``hacrl train`` (or any hacrl sub-command) as a NeMo-Run experiment.

::

    from hacrl_megatron.launch import SlurmJob, launch_train, slurm_executor
    ex = slurm_executor(SlurmJob("my_account", "batch", nodes=2, gpus_per_node=8, container_image="nvcr.io/..."))
    result = launch_train("paper_qwen3_4b_with_instruct", ["train.steps=200"], ex, name="hacpo-4b")

On Slurm the job first builds a Ray cluster over its nodes (:mod:`hacrl_megatron.launch.slurm_ray`)
and runs the command on the head node; elsewhere the command runs directly and Ray agents start a
private Ray instance. NeMo-Run gotchas handled here (docs/measured.md §4):
``run.Script(path=...)`` would default to ``entrypoint="bash"``, so the command is a ``python -m``
script; a failed job still lets ``exp.run`` return normally, so the task's final state is read
back and a failure raises :class:`LaunchError` (``check=True``) naming the state and the log;
NeMo-Run submits every Slurm job as ``sbatch --requeue`` (hard-coded in its scheduler), so the
command line is made to agree with the job's own ``#SBATCH --requeue``/``--no-requeue``
(:func:`_sbatch_requeue_agrees`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hacrl_megatron.launch.executors import python_executable, require_nemo_run
from hacrl_megatron.launch.slurm_ray import ray_cluster_script

SUBCOMMANDS = ("train", "pretrain", "config")  # those that take --preset and overrides


class LaunchError(RuntimeError):
    """A launched job did not succeed (message names the job, its final state and its log)."""


@dataclass(frozen=True)
class LaunchResult:
    """Outcome of :func:`launch_train`.

    name: the task name inside the experiment. experiment_id: NeMo-Run's id
    (``nemo experiment status <id>``). state: the task's final (or, detached, current) state,
    e.g. ``SUCCEEDED``, ``FAILED``, ``SUBMITTED``; ``DRYRUN`` when nothing was submitted.
    ok: succeeded, or submitted/dry-run and not failed. job_dir: the task's local directory.
    log_path: its combined log when the executor writes one locally, else None.
    """

    name: str
    experiment_id: str
    state: str
    ok: bool
    job_dir: str
    log_path: str | None


def hacrl_command(subcommand: str, preset: str | None, overrides: list[str] | None, *, python: str = "python",
                  extra_args: list[str] | None = None) -> list[str]:
    """``python -m hacrl_megatron <subcommand> [--preset P] [extra_args] [overrides]`` as argv."""
    if subcommand not in SUBCOMMANDS:
        raise ValueError(f"subcommand={subcommand!r}: must be one of {list(SUBCOMMANDS)}")
    for ov in overrides or []:
        if "=" not in ov:
            raise ValueError(f"override {ov!r}: expected dotted.key=value")
    cmd = [python, "-m", "hacrl_megatron", subcommand]
    if preset:
        cmd += ["--preset", preset]
    return cmd + list(extra_args or []) + list(overrides or [])


def build_task(preset: str | None, overrides: list[str] | None, executor: Any, *, subcommand: str = "train",
               ray_cluster: bool | None = None, extra_args: list[str] | None = None, agent: str | None = None,
               **ray_script: Any) -> Any:
    """The ``run.Script`` for one hacrl command on ``executor``.

    ``ray_cluster``: wrap the command in the Ray-cluster script (default: on Slurm executors);
    ``ray_script``: keyword arguments of :func:`ray_cluster_script` (port, wait_timeout_s, ...);
    ``agent``: the job trains that agent alone (``hacrl train --agent``): its nodes are planned for it alone.
    """
    run = require_nemo_run()
    python = python_executable(executor)
    cmd = hacrl_command(subcommand, preset, overrides, python=python, extra_args=extra_args)
    if ray_cluster is None:
        ray_cluster = isinstance(executor, run.SlurmExecutor)
    if ray_cluster:
        if isinstance(executor, run.SlurmExecutor) and "head_gpu_ids" not in ray_script:
            ray_script = {**_slurm_placement(preset, overrides, executor, agent), **ray_script}
        return run.Script(inline=ray_cluster_script(cmd, python=python, **ray_script), entrypoint="bash")
    # a python -m script: run.Script's default entrypoint is bash, which cannot run a module
    return run.Script(path="hacrl_megatron", args=cmd[3:], entrypoint=python, m=True)


def _slurm_placement(preset: str | None, overrides: list[str] | None, executor: Any,
                     agent: str | None = None) -> dict[str, Any]:
    """``head_gpu_ids`` and the placement header for a Slurm job of ``preset`` (of its agent ``agent`` alone)
    (:mod:`hacrl_megatron.launch.placement`); {} when the config cannot be read here."""
    from hacrl_megatron.config import ConfigError, load_config
    from hacrl_megatron.launch.placement import PlacementError, job_config, node_plan

    if not executor.gpus_per_node:
        return {}  # CPU nodes: nothing to place
    try:
        cfg = load_config(preset, overrides)
    except (ConfigError, OSError):
        return {}  # --no-validate: a preset that exists only on the cluster
    if agent is not None:
        cfg = job_config(cfg, agent)
    try:
        plan = node_plan(cfg, int(executor.nodes), int(executor.gpus_per_node))
    except PlacementError as err:
        raise LaunchError(f"{executor.nodes} node(s) x {executor.gpus_per_node} GPUs: {err}") from None
    head = None if plan.head_gpu_ids is None else list(plan.head_gpu_ids)
    return {"head_gpu_ids": head, "placement": plan.describe()}


def local_slurm_base_dir(executor: Any, base_dir: str | None, dryrun: bool = False) -> str | None:
    """The experiment folder of a Slurm job submitted from this machine (a ``LocalTunnel``), made the
    folder sbatch reads the job's files from; other executors: ``base_dir`` unchanged.

    NeMo-Run writes the files under ``<base_dir>/experiments/<name>/<id>`` but submits
    ``<tunnel job_dir>/<name>/<id>/<name>_sbatch.sh``, copying between them only over SSH; on the
    login node both must be one folder. The job folder (``SlurmJob.job_dir``) is the experiment
    folder when given, else ``base_dir`` (default: NeMo-Run's home). When both are given and differ,
    a dry run writes under ``base_dir`` a script naming the job folder; a submission is refused
    (ValueError).
    """
    run = require_nemo_run()
    tunnel = getattr(executor, "tunnel", None)
    if not isinstance(executor, run.SlurmExecutor) or not isinstance(tunnel, run.LocalTunnel):
        return base_dir
    if tunnel.job_dir and base_dir and os.path.abspath(tunnel.job_dir) != os.path.abspath(base_dir):
        if dryrun:
            return base_dir
        raise ValueError(f"job_dir={tunnel.job_dir!r} and base_dir={base_dir!r}: a Slurm job submitted from this "
                         "machine keeps its files in one folder; give one of them")
    from nemo_run.config import get_nemorun_home

    base = os.path.abspath(base_dir or tunnel.job_dir or get_nemorun_home())
    tunnel.job_dir = os.path.join(base, "experiments")
    return base


@contextlib.contextmanager
def _sbatch_requeue_agrees() -> Iterator[None]:
    """While it is open, every sbatch request NeMo-Run renders and submits carries ``--requeue`` on
    its command line only when its executor asks for it (``#SBATCH --requeue``), else ``--no-requeue``:
    NeMo-Run 0.11 hard-codes ``sbatch --requeue --parsable``, and the command line overrides the
    script's ``#SBATCH`` lines. The request's command is fixed when it is rendered (``materialize``),
    before it is written and submitted.

    NeMo-Run also submits with ``tunnel.run(" ".join(launch_cmd + [script]))``, a shell line in which a
    script path holding a space (a job folder under "My Projects") splits into two arguments: while
    this is open, the local tunnel quotes the script path of the sbatch lines it rendered."""
    from nemo_run.core.execution.slurm import SlurmBatchRequest
    from nemo_run.core.tunnel.client import LocalTunnel

    original, original_run = SlurmBatchRequest.materialize, LocalTunnel.run
    rendered: set[str] = set()

    def materialize(self: Any) -> str:
        wanted = "--requeue" if (self.executor.additional_parameters or {}).get("requeue") else "--no-requeue"
        self.launch_cmd = [wanted if arg in ("--requeue", "--no-requeue") else arg for arg in self.launch_cmd]
        rendered.add(" ".join(self.launch_cmd) + " ")
        return original(self)

    def run(self: Any, command: str, *args: Any, **kwargs: Any) -> Any:
        for prefix in rendered:
            script = command[len(prefix):]
            if command.startswith(prefix) and script.endswith("_sbatch.sh") and os.path.isfile(script):
                command = prefix + shlex.quote(script)
                break
        return original_run(self, command, *args, **kwargs)

    SlurmBatchRequest.materialize, LocalTunnel.run = materialize, run
    try:
        yield
    finally:
        SlurmBatchRequest.materialize, LocalTunnel.run = original, original_run


def _state_name(state: Any) -> str:
    return getattr(state, "name", None) or str(state).split(" ")[0]


def _log_path(job_dir: str) -> str | None:
    logs = sorted(glob.glob(os.path.join(job_dir, "**", "combined.log"), recursive=True)) or \
        sorted(glob.glob(os.path.join(job_dir, "**", "*.out"), recursive=True))
    return logs[-1] if logs else None


def launch_train(preset: str | None, overrides: list[str] | None, executor: Any, name: str = "hacrl", *,
                 subcommand: str = "train", base_dir: str | None = None, detach: bool = False,
                 tail_logs: bool = False, dryrun: bool = False, check: bool = True,
                 ray_cluster: bool | None = None, extra_args: list[str] | None = None, agent: str | None = None,
                 **ray_script: Any) -> LaunchResult:
    """Run ``hacrl <subcommand> --preset <preset> <overrides>`` as NeMo-Run experiment ``name``.

    Blocks until the job ends unless ``detach`` (Slurm: returns once submitted). ``dryrun``
    writes the job files (e.g. the sbatch script) under ``base_dir`` without submitting.
    ``check``: raise :class:`LaunchError` when the job failed or was cancelled. ``agent``: the job is
    ``hacrl train --agent <agent>``, one agent of the config trained alone (docs/exchange.md).
    """
    run = require_nemo_run()
    if agent is not None:
        extra_args = ["--agent", agent, *(extra_args or [])]
    task = build_task(preset, overrides, executor, subcommand=subcommand, ray_cluster=ray_cluster,
                      extra_args=extra_args, agent=agent, **ray_script)
    base_dir = local_slurm_base_dir(executor, base_dir, dryrun)
    # exp._id / exp._exp_dir: NeMo-Run 0.11 has no public accessor for the id it prints and stores
    slurm = _sbatch_requeue_agrees() if isinstance(executor, run.SlurmExecutor) else contextlib.nullcontext()
    with slurm, run.Experiment(name, base_dir=base_dir, log_level="WARN") as exp:
        exp.add(task, executor=executor, name=name)
        if dryrun:
            exp.dryrun(log=False, delete_exp_dir=False)
            return LaunchResult(name, exp._id, "DRYRUN", True, executor.job_dir or exp._exp_dir, None)
        exp.run(sequential=True, detach=detach, tail_logs=tail_logs)
    # leaving the context is what waits for a non-detached job; only then is its state final
    info = (exp.status(return_dict=True) or {}).get(name, {})
    state = _state_name(info.get("status", "UNKNOWN"))
    job_dir = str(info.get("local_dir") or executor.job_dir)
    finished_ok = state == "SUCCEEDED"
    ok = finished_ok or (detach and state in ("SUBMITTED", "PENDING", "RUNNING", "UNKNOWN"))
    result = LaunchResult(name, exp._id, state, ok, job_dir, _log_path(job_dir))
    if check and not ok:
        raise LaunchError(f"job {name!r} (experiment {exp._id}) ended in state {state}; "
                          f"log: {result.log_path or job_dir}{_tail(result.log_path)}")
    return result


def _tail(path: str | None, lines: int = 15) -> str:
    """The last ``lines`` lines of a log, indented, for error messages ('' when unreadable)."""
    if not path:
        return ""
    try:
        with open(path, errors="replace") as f:
            last = f.read().splitlines()[-lines:]
    except OSError:
        return ""
    return "".join(f"\n  | {line}" for line in last)
