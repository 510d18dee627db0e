"""torch.distributed + megatron-core parallel state for one agent (one agent = one Megatron world).

:func:`init_parallel` is the only entry point. In a launched job (torchrun, mp.spawn with the usual
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` variables, a Ray worker that sets them, or
a local spawn with :func:`local_world_env`'s rendezvous file) it joins that world; otherwise it
creates a single-process world backed by an in-memory store (no port, no file). megatron-core keeps
its parallel state per process, so a second call in the same process must ask for the same sizes:
that is how several TP = PP = DP = 1 agents share one controller process (docs/architecture.md,
"local" mode).

Network exposure: a world whose ranks all run on this machine (the single-process world, a
rendezvous file, or ``MASTER_ADDR`` on loopback, which Ray agents use when all their ranks share a
node) listens on the loopback interface only: the rendezvous store binds 127.0.0.1 and gloo uses
the loopback interface unless ``GLOO_SOCKET_IFNAME`` says otherwise. NCCL's interface is left to
NCCL (``NCCL_SOCKET_IFNAME``): the same process may also join a weight-update group with SGLang
servers on other nodes (``sync/distributed.py``), which a loopback-only NCCL could not reach.
Multi-node worlds listen on rank 0's node address (``MASTER_ADDR``, the store is bound to it, not to
every interface) without authentication and rely on a private cluster network (docs/security.md,
"In short").
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import ipaddress
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from hacrl_megatron.config.layout import LayoutError, expert_data_parallel
from hacrl_megatron.models.cpu_compat import enable_cpu_compat
from hacrl_megatron.net import (
    bound_tcp_store,
    free_port,  # noqa: F401  (re-exported: test worlds and tests import it from here)
)


class ParallelStateError(RuntimeError):
    """The process's world or megatron parallel state does not match what an agent asks for."""


@dataclass(frozen=True)
class ParallelInfo:
    """This rank's place in the agent's world."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    world_size: int
    rank: int
    ep: int = 1  # expert-parallel size (experts laid out over the tp·cp·dp ranks of a stage)
    etp: int = 1  # expert tensor-parallel size
    ep_rank: int = 0
    cp: int = 1  # context-parallel size: each row split over cp ranks (agents/context_parallel.py)
    cp_rank: int = 0


logger = logging.getLogger(__name__)
INIT_FILE_ENV = "HACRL_DIST_INIT_FILE"
# Environment of every Megatron rank on CUDA (the Slurm script, Ray workers, init_parallel): one CUDA
# work queue per device, so kernels run in issue order and Megatron's TP/SP communication overlaps
# compute as it schedules it. The CUDA driver reads it when the process creates its context.
CUDA_RANK_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def cuda_rank_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """:data:`CUDA_RANK_ENV` with the values ``environ`` (default ``os.environ``) already sets kept."""
    environ = os.environ if environ is None else environ
    return {key: environ.get(key, value) for key, value in CUDA_RANK_ENV.items()}


def export_cuda_rank_env() -> None:
    """Set :data:`CUDA_RANK_ENV` in this process where unset, before its CUDA context exists; when the
    context already exists (CUDA used before the first agent was built) say that it comes too late."""
    missing = {k: v for k, v in CUDA_RANK_ENV.items() if k not in os.environ}
    os.environ.update(missing)
    if missing and torch.cuda.is_initialized():
        logger.warning("%s set after this process initialised CUDA: it applies to the processes it starts, not to "
                       "its own Megatron ranks; export it before starting hacrl", ", ".join(missing))


def local_world_env(rank: int, world: int, init_file: str) -> dict[str, str]:
    """Environment of rank ``rank`` in a world spawned on this machine (tests, ``hacrl convert``).

    The ranks meet through ``init_file`` (a path that does not exist yet) instead of a TCP port, so
    concurrent jobs on a shared machine cannot race for a "free" port.
    """
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), INIT_FILE_ENV: init_file}


@contextlib.contextmanager
def local_rendezvous(prefix: str = "hacrl_world_") -> Iterator[str]:
    """A rendezvous file path for :func:`local_world_env`, inside a fresh temporary folder that is
    removed when the block ends, normally or by an error (so spawned worlds leave nothing behind)."""
    folder = tempfile.mkdtemp(prefix=prefix)
    try:
        yield os.path.join(folder, "rendezvous")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def spawn_local_world(fn: Callable[..., None], world: int, args: tuple = (), prefix: str = "hacrl_world_") -> None:
    """Run ``fn(rank, world, init_file, *args)`` in ``world`` processes spawned on this machine, meeting
    at a :func:`local_rendezvous` file; returns when every rank has returned.

    When ranks fail, the error raised (``torch.multiprocessing.ProcessRaisedException``) is that of the
    **first** rank to fail. A failing rank makes its peers fail in their next collective ("Connection
    closed by peer"), and ``mp.spawn`` alone reports whichever failed process it notices first, so
    the cause (a full disk, a bad output path) could hide behind a peer's network error.
    ``fn`` must be a module-level function (it is pickled into the spawned processes).
    """
    import torch.multiprocessing as mp

    with local_rendezvous(prefix) as init_file:
        try:
            mp.spawn(_run_recording_failure, args=(fn, world, init_file, args), nprocs=world, join=True)
        except mp.ProcessRaisedException as err:
            raise first_failure(err, os.path.dirname(init_file)) from None


def _run_recording_failure(rank: int, fn: Callable[..., None], world: int, init_file: str, args: tuple) -> None:
    try:
        fn(rank, world, init_file, *args)
    except BaseException:
        record = {"time": time.time(), "rank": rank, "pid": os.getpid(), "trace": traceback.format_exc()}
        with contextlib.suppress(OSError):  # a full disk must not replace the rank's own error
            with open(os.path.join(os.path.dirname(init_file), f"failure-rank{rank}.json"), "w") as f:
                json.dump(record, f)
        raise


def first_failure(err: Exception, folder: str) -> Exception:
    """The failure to report for a spawned world: ``err`` (what ``mp.spawn`` raised), or, when a rank
    recorded an earlier failure in ``folder`` (``failure-rank<r>.json``), a ``ProcessRaisedException``
    with that rank's traceback."""
    import torch.multiprocessing as mp

    records = []
    for path in glob.glob(os.path.join(folder, "failure-rank*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            with open(path) as f:
                record = json.load(f)
            records.append((float(record["time"]), int(record["rank"]), int(record["pid"]), str(record["trace"])))
    if not records:
        return err
    _, rank, pid, trace = min(records)
    if rank == getattr(err, "error_index", None):
        return err
    later = getattr(err, "error_index", "?")
    return mp.ProcessRaisedException(
        f"\n\n-- Process {rank} terminated with the following error (the first rank to fail; process {later} "
        f"failed after it):\n{trace}", rank, pid)


LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_interface() -> str | None:
    """Name of the network interface that holds 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS)."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and is_loopback(a.address) for a in addrs):
                return name
    except ImportError:
        pass
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def _use_loopback_interface() -> None:
    """gloo's sockets on the loopback interface, unless the user chose an interface."""
    name = loopback_interface()
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)


def _loopback_store(rank: int, world: int, port: int) -> object:
    """The world's TCPStore; rank 0's server listens on 127.0.0.1 only (torch's own binds every interface)."""
    from torch.distributed.constants import default_pg_timeout

    return bound_tcp_store(LOOPBACK, port, world, rank == 0, default_pg_timeout)


def _init_process_group(backend: str) -> None:
    import torch.distributed as dist

    if INIT_FILE_ENV in os.environ:  # ranks spawned on this machine
        _use_loopback_interface()
        dist.init_process_group(backend=backend, init_method=f"file://{os.environ[INIT_FILE_ENV]}",
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        return
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if is_loopback(os.environ["MASTER_ADDR"]):  # one node: nothing listens on its network
            _use_loopback_interface()
            store = _loopback_store(rank, world, int(os.environ["MASTER_PORT"]))
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)
        else:  # multi-node: the cluster network is trusted (docs/security.md, "In short"); the store listens on
            # rank 0's node address only (MASTER_ADDR), not on every interface of that node
            from torch.distributed.constants import default_pg_timeout

            store = bound_tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                                    default_pg_timeout)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)
        return
    _use_loopback_interface()  # a world of one process: an in-memory store, nothing on disk
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


MEGATRON_HINT = "pip install 'megatron-core>=0.16.1,<0.20' psutil einops  (or: pip install -e '.[megatron]')"


def require_megatron() -> None:
    """Raise an ImportError that says what to install when megatron-core is missing."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as err:
        raise ImportError(f"Megatron agents need megatron-core: {MEGATRON_HINT}") from err


def init_parallel(tp: int = 1, pp: int = 1, dp: int = 1, backend: str | None = None, seed: int = 0,
                  ep: int = 1, etp: int = 1, cp: int = 1) -> ParallelInfo:
    """Initialise torch.distributed and megatron's parallel state with explicit sizes.

    ``cp``: context-parallel size (megatron's ``context_parallel_size``; its ranks are adjacent after
    TP's in megatron's "tp-cp-ep-dp-pp" order); the world is ``tp·pp·cp·dp`` ranks.
    ``ep``/``etp``: expert-parallel and expert tensor-parallel sizes of an MoE agent; the experts use
    the same ``tp·cp·dp`` ranks of each stage as attention (``ep·etp`` must divide ``tp·cp·dp``), so the
    world stays ``tp·pp·cp·dp`` ranks.

    ``backend``: "gloo" (CPU) or "nccl" (GPU); default: nccl when CUDA is available.
    ``seed``: megatron's ``model_parallel_cuda_manual_seed`` (TP-rank-dependent dropout RNG); on CPU
    this also reseeds the default CPU generator (the compat layer maps the CUDA RNG onto it).
    Raises :class:`ParallelStateError` when the world size is not ``tp * pp * cp * dp`` or megatron was
    already initialised with other sizes.
    """
    require_megatron()
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    enable_cpu_compat()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ParallelStateError("backend='nccl' needs CUDA; use backend='gloo' on CPU")
    if not dist.is_initialized():
        if backend == "nccl":
            export_cuda_rank_env()  # before set_device creates this rank's CUDA context
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        _init_process_group(backend)
        atexit.register(_close_world_at_exit)  # once per world: a no-op when shutdown_parallel ran first
    world = dist.get_world_size()
    if world != tp * pp * cp * dp:
        raise ParallelStateError(
            f"world size {world} != tp*pp*cp*dp = {tp}*{pp}*{cp}*{dp}; an agent with tp/pp/cp/dp > 1 must be launched "
            "in its own world (torchrun / mp.spawn with that many processes)"
        )
    try:
        expert_data_parallel(tp, dp, ep, etp, cp)
    except LayoutError as err:
        raise ParallelStateError(str(err)) from None
    if mpu.model_parallel_is_initialized():
        have = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size(),
                mpu.get_data_parallel_world_size(), mpu.get_expert_model_parallel_world_size(),
                mpu.get_expert_tensor_parallel_world_size(), mpu.get_context_parallel_world_size())
        if have != (tp, pp, dp, ep, etp, cp):
            raise ParallelStateError(
                f"megatron parallel state already initialised with tp, pp, dp, ep, etp, cp = {have}; this process "
                f"cannot also host an agent with {(tp, pp, dp, ep, etp, cp)} (one Megatron layout per process)"
            )
    else:
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                      context_parallel_size=cp, expert_model_parallel_size=ep,
                                      expert_tensor_parallel_size=etp)
    if mpu.get_context_parallel_world_size() != cp:  # megatron builds the groups it was asked for: say so if not
        raise ParallelStateError(f"megatron's context-parallel group has {mpu.get_context_parallel_world_size()} "
                                 f"ranks, the agent asked for cp={cp}")
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return parallel_info()


def parallel_info() -> ParallelInfo:
    """Sizes and ranks of the current megatron parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    return ParallelInfo(
        tp=mpu.get_tensor_model_parallel_world_size(),
        pp=mpu.get_pipeline_model_parallel_world_size(),
        dp=mpu.get_data_parallel_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        ep=mpu.get_expert_model_parallel_world_size(),
        etp=mpu.get_expert_tensor_parallel_world_size(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        cp=mpu.get_context_parallel_world_size(),
        cp_rank=mpu.get_context_parallel_rank(),
    )


def shutdown_parallel() -> None:
    """Close this process's world before it exits: a barrier, megatron's groups, then torch's.

    Every rank of a spawned or launched world calls it once its work is done. Without it, a rank
    that returns first leaves the interpreter while gloo's worker threads still hold tensors, and
    interpreter teardown can then abort the process (SIGABRT); the barrier also keeps a rank from
    closing its sockets while another still finishes a collective. A no-op when no world exists.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    dist.barrier()
    _destroy_world()


def _destroy_world() -> None:
    import torch.distributed as dist

    with contextlib.suppress(ImportError):
        from megatron.core import parallel_state as mpu

        mpu.destroy_model_parallel()
    dist.destroy_process_group()


def _close_world_at_exit() -> None:
    """atexit hook of :func:`init_parallel`: a world still open when the interpreter ends (a
    controller process, a test session) is destroyed while Python is fully alive, not during
    finalization. No barrier: the other ranks may be gone already."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        _destroy_world()
    except Exception as err:  # the process is ending anyway: say so, never mask the exit status
        print(f"hacrl_megatron: closing the torch.distributed world at exit failed: {err!r}", file=sys.stderr)
