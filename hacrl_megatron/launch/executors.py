"""NeMo-Run executors for hacrl jobs: this machine, a Slurm cluster (one Ray node per Slurm node), Docker.

Each function returns a plain ``nemo_run`` executor with the fields hacrl needs set and everything
else at NeMo-Run's defaults; pass ``**extra`` for any other executor field. ``nemo_run`` is
imported lazily (``pip install 'hacrl_megatron[launch]'``).

Code shipping (``packager``): ``"git"`` archives the committed checkout (``GitArchivePackager``,
NeMo-Run's default: uncommitted edits are *not* shipped) into ``/nemo_run/code``, the job's working
directory; ``"none"`` runs what the container image already has installed. NeMo-Run's packager puts the
checkout's and the job folder's paths into shell commands unquoted, so a checkout under a folder with a
space fails in ``git rev-parse``; :func:`_packager` gives a subclass that archives such paths itself, with
the same archive (the committed tree at ``ref``; launch/git_packager.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: hacrl_megatron's parent directory: put on PYTHONPATH so an uninstalled checkout runs locally
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
LAUNCH_INSTALL_HINT = "pip install nemo-run 'leptonai==0.27.3'  (or: pip install 'hacrl_megatron[launch]')"
PACKAGERS = ("git", "none")


def require_nemo_run() -> Any:
    """The ``nemo_run`` module, or an ImportError that says what to install."""
    try:
        import nemo_run
    except ImportError as err:
        raise ImportError(f"hacrl launch needs NeMo-Run, which is not installed or broken ({err}): "
                          f"{LAUNCH_INSTALL_HINT}") from err
    return nemo_run


def _packager(run: Any, kind: str) -> Any:
    if kind not in PACKAGERS:
        raise ValueError(f"packager={kind!r}: must be one of {list(PACKAGERS)} (git: ship the committed "
                         "checkout; none: the container image has hacrl_megatron installed)")
    if kind == "none":
        return run.Packager()
    from hacrl_megatron.launch.git_packager import QuotingGitArchivePackager  # imports nemo_run

    return QuotingGitArchivePackager()


def _env(env_vars: dict[str, str] | None) -> dict[str, str]:
    # unbuffered output so `nemo experiment logs` and Slurm logs show progress as it happens; the
    # Megatron rank defaults (CUDA_DEVICE_MAX_CONNECTIONS=1) for local and container runs as for Slurm's
    from hacrl_megatron.models.parallel import cuda_rank_env

    return {"PYTHONUNBUFFERED": "1", **cuda_rank_env(), **(env_vars or {})}


def local_executor(*, env_vars: dict[str, str] | None = None, **extra: Any) -> Any:
    """Run on this machine (one subprocess: the CPU demo, tests, a single GPU box; Ray agents start
    a private Ray instance inside it).

    PYTHONPATH starts with this checkout, so ``python -m hacrl_megatron`` works uninstalled.
    """
    run = require_nemo_run()
    path = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return run.LocalExecutor(env_vars={"PYTHONPATH": path, **_env(env_vars)}, **extra)


@dataclass(frozen=True)
class SlurmJob:
    """An sbatch job of ``nodes`` nodes with one task per node (each task is one Ray node; the agents'
    ranks are Ray actors, see :mod:`hacrl_megatron.agents.ray_agent`).

    account, partition, time: sbatch ``--account``, ``--partition``, ``--time`` (HH:MM:SS).
    nodes, gpus_per_node: sbatch ``--nodes`` and ``--gpus-per-node`` (None: CPU nodes).
    container_image: pyxis/enroot image for ``srun --container-image`` (None: bare metal): a
        registry reference (``nvcr.io/acme/hacrl:0.1``), or a squashfs file every node reads from a
        shared filesystem (an absolute path ending in ``.sqsh``, e.g. made by ``enroot import``; no
        pull per node).
    container_mounts: ``src:dst`` mounts (data, checkpoints, HF models).
    cpus_per_task: CPUs Ray may use on each node (default: what Slurm gives one task; set it to the
        node's cores when not running ``exclusive``).
    job_dir: directory for job files and logs on the cluster's shared filesystem; required with
        ``ssh_host``, default ``~/.nemo_run/experiments`` when launching on the login node.
    ssh_host, ssh_user: submit over SSH from another machine (``run.SSHTunnel``); default: this
        machine is the login node (``run.LocalTunnel``).
    mem: sbatch ``--mem`` per node; ``"0"`` (default): all of each node's memory (Ray's object store
        and the controller's host copies need it; a partition's default share can be a few GB).
    requeue: sbatch ``--requeue`` (Slurm restarts the job after a node failure or preemption); off
        (``--no-requeue``) by default, since a restarted job is a new run unless it resumes
        (``hacrl launch --requeue`` needs ``checkpoint.resume=true``).
    """

    account: str
    partition: str | None = None
    nodes: int = 1
    gpus_per_node: int | None = None
    container_image: str | None = None
    time: str = "04:00:00"
    container_mounts: tuple[str, ...] = ()
    cpus_per_task: int | None = None
    exclusive: bool | None = True
    job_dir: str | None = None
    ssh_host: str | None = None
    ssh_user: str | None = None
    mem: str | None = "0"
    requeue: bool = False

    def __post_init__(self) -> None:
        check_container_image(self.container_image)
        if self.nodes < 1:
            raise ValueError(f"nodes={self.nodes}: must be >= 1")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node={self.gpus_per_node}: must be >= 0 (or None for CPU nodes)")
        if self.ssh_host is not None and not (self.ssh_user and self.job_dir):
            raise ValueError(f"ssh_host={self.ssh_host!r} needs ssh_user and job_dir (a directory on the cluster)")
        object.__setattr__(self, "container_mounts", tuple(self.container_mounts))  # a list is accepted too


def check_container_image(image: str | None) -> None:
    """A squashfs image is a file path for pyxis: absolute (every node resolves it the same way) and
    ending in ``.sqsh``; anything else not starting with ``/``, ``.`` or ``~`` is a registry reference."""
    if image is None:
        return
    if image.startswith(("/", ".", "~")) or image.endswith(".sqsh"):
        if not (image.startswith("/") and image.endswith(".sqsh") and len(image) > len("/.sqsh")):
            raise ValueError(f"container_image={image!r}: a squashfs image must be an absolute path ending in .sqsh "
                             "on the cluster's shared filesystem (e.g. /shared/images/hacrl.sqsh)")


def slurm_executor(job: SlurmJob, *, env_vars: dict[str, str] | None = None, packager: str = "git",
                   **extra: Any) -> Any:
    """The NeMo-Run ``SlurmExecutor`` for ``job`` (see :class:`SlurmJob`). ``#SBATCH --requeue`` or
    ``--no-requeue`` follows ``job.requeue``; :func:`~hacrl_megatron.launch.recipes.launch_train`
    makes the ``sbatch`` command line agree (NeMo-Run always passes ``--requeue`` there)."""
    run = require_nemo_run()
    params = {**(extra.pop("additional_parameters", None) or {}),
              **({"requeue": True} if job.requeue else {"no_requeue": True})}
    if job.ssh_host is not None:
        tunnel = run.SSHTunnel(host=job.ssh_host, user=job.ssh_user, job_dir=job.job_dir)
    else:
        tunnel = run.LocalTunnel(job_dir=job.job_dir or "")
    return run.SlurmExecutor(
        account=job.account, partition=job.partition, nodes=job.nodes, ntasks_per_node=1,
        gpus_per_node=job.gpus_per_node or None, cpus_per_task=job.cpus_per_task, exclusive=job.exclusive,
        time=job.time, container_image=job.container_image, container_mounts=list(job.container_mounts),
        mem=job.mem, additional_parameters=params, env_vars=_env(env_vars), tunnel=tunnel,
        packager=_packager(run, packager), **extra,
    )


def docker_executor(container_image: str, *, num_gpus: int | None = -1, volumes: list[str] | None = None,
                    env_vars: dict[str, str] | None = None, shm_size: str = "16g", packager: str = "git",
                    **extra: Any) -> Any:
    """One container on this Docker host (``num_gpus=-1``: all GPUs through the nvidia runtime;
    None or 0: a CPU container). ``ipc=host`` and a large ``/dev/shm``: Ray's object store and NCCL
    both use shared memory."""
    run = require_nemo_run()
    gpu = bool(num_gpus)
    return run.DockerExecutor(
        container_image=container_image, num_gpus=num_gpus if gpu else None, runtime="nvidia" if gpu else None,
        ipc_mode="host", shm_size=shm_size, volumes=list(volumes or []), env_vars=_env(env_vars),
        packager=_packager(run, packager), **extra,
    )


def python_executable(executor: Any) -> str:
    """The interpreter a job should use: this one on the local machine, ``python`` in images/clusters."""
    run = require_nemo_run()
    return sys.executable if isinstance(executor, run.LocalExecutor) else "python"
