"""Start, health-check, restart and stop SGLang servers (GPU clusters); start an agent's servers.

``SGLangServer(model_path, gpu_ids=[0, 1], tp_size=2).start()`` runs
``python -m sglang.launch_server --model-path ... --host 127.0.0.1 --port P --tp-size 2`` with
``CUDA_VISIBLE_DEVICES=0,1`` in its own session, waits for ``/health`` and returns the base URL for
:class:`~hacrl_megatron.rollout.SGLangEngine`. The server runs through ``server_guard.py``
(``servers.launch``): its whole process group ends when the trainer dies, even by ``kill -9``.
``stop()`` ends exactly the process group it started (SIGTERM, then SIGKILL after a grace period;
what is left of it even when the server's main process already died) — never other processes.

:func:`start_engines` is ``rollout.engine: sglang``'s starter (``rollout/launch.py``): the agent's
``agents.N.rollout_gpu_ids`` list k · ``rollout.sglang.tp`` GPUs, k servers, one per consecutive
group (empty: one server that inherits this process's GPUs); colocated servers
(``rollout.colocate``) start with ``--enable-memory-saver`` so that they can release their memory
while the trainer trains.

``cpu=True`` (``rollout.sglang.cpu``) runs SGLang's Python server with CPU torch: ``SGLANG_USE_CPU_ENGINE=1``
and :data:`CPU_FLAGS` (torch-native attention and sampler; SGLang's own CPU kernels are not published,
so the server's environment needs the recipe of ``tests/fixtures/sglang_cpu/``: ``.ci/sglang.sh install``).
An API key never appears on the command line or in the log (``rollout/server_secrets.py``).
Standard library only.
"""

from __future__ import annotations

import os
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
from hacrl_megatron.rollout.server_secrets import KeyConfig, RedactingPump, open_private_log
from hacrl_megatron.rollout.servers import (
    end_group,
    engine_model_dir,
    gpu_groups,
    launch,
    start_all,
    startup_failure,
    trainer_dtype,
)
from hacrl_megatron.rollout.sglang_engine import SGLangEngine

if TYPE_CHECKING:
    from hacrl_megatron.config import AgentConfig, ExperimentConfig

SGLANG_PYTHON_ENV = "HACRL_SGLANG_PYTHON"  # same variable as hacrl_megatron.config.SGLANG_PYTHON_ENV
MEMORY_SAVER_FLAG = "--enable-memory-saver"
# SGLang's server on CPU torch alone: the CPU engine, torch-native attention and sampling (the CPU default,
# intel_amx, needs SGLang's unpublished CPU kernels), no overlap scheduler, no warm-up request, no grammar
# backend, a KV cache of at most this many tokens (else a share of the host's memory)
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
CPU_FLAGS = (("--device", "cpu"), ("--attention-backend", "torch_native"), ("--sampling-backend", "pytorch"),
             ("--disable-overlap-schedule",), ("--skip-server-warmup",), ("--grammar-backend", "none"),
             ("--max-total-tokens", "32768"))


def cpu_flags(given: Sequence[str]) -> list[str]:
    """:data:`CPU_FLAGS` except those ``given`` sets already (a flag in ``rollout.sglang.args`` wins)."""
    named = {a.split("=", 1)[0] for a in given}
    return [part for flag in CPU_FLAGS if flag[0] not in named for part in flag]


def sglang_python(configured: str | os.PathLike | None = None) -> str:
    """The interpreter for ``python -m sglang.launch_server``: ``configured`` (``rollout.sglang.python``),
    else ``$HACRL_SGLANG_PYTHON`` (the container image sets it to its SGLang venv), else this Python."""
    return str(configured) if configured else os.environ.get(SGLANG_PYTHON_ENV) or sys.executable



def server_healthy(base_url: str, timeout: float = 5.0) -> bool:
    """Whether the server at ``base_url`` answers ``GET /health`` with 200 within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False

class SGLangServerError(RuntimeError):
    """The server process failed to start or died; the message carries the tail of its log."""


class SGLangServer:
    """One SGLang server process.

    Args:
        model_path: HF model folder (the agent's initial weights, also the config source for
            disk weight sync).
        host / port: where to listen (port: a free one when None).
        tp_size: tensor-parallel size of the server (its GPUs = ``gpu_ids``).
        gpu_ids: GPUs for ``CUDA_VISIBLE_DEVICES``; None leaves the environment as is.
        mem_fraction_static: SGLang's ``--mem-fraction-static`` (KV-cache share of GPU memory);
            lower it when the trainer shares the GPUs.
        extra_args: further ``launch_server`` flags, e.g. ``["--enable-memory-saver"]``.
        log_path: server stdout/stderr file (default: a file in the current directory).
        command: the full command line instead of ``python -m sglang.launch_server ...``
            (tests; custom launchers). ``{port}`` and ``{host}`` in it are substituted.
        python: interpreter for ``-m sglang.launch_server`` (SGLang in its own virtual
            environment, config ``rollout.sglang.python``); None: :func:`sglang_python`'s fallbacks.
        api_key: SGLang's API key: the server then refuses every request but ``/health`` without
            ``Authorization: Bearer <key>``. It goes in a private YAML file named by ``--config``
            (appended to a custom command too; the file exists only while the server starts) and is
            redacted from the server's log; it is never on the command line.
        cpu: run SGLang's server with CPU torch (:data:`CPU_ENV`, :data:`CPU_FLAGS`).
    """

    def __init__(self, model_path: str | os.PathLike | None, *, host: str = "127.0.0.1", port: int | None = None,
                 tp_size: int = 1, gpu_ids: Sequence[int] | None = None, mem_fraction_static: float | None = None,
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike | None = None,
                 command: Sequence[str] | None = None, python: str | os.PathLike | None = None,
                 api_key: str | None = None, cpu: bool = False) -> None:
        if command is None and model_path is None:
            raise ValueError("SGLangServer: model_path is required unless a command is given")
        if tp_size < 1:
            raise ValueError(f"SGLangServer: tp_size={tp_size} must be >= 1")
        if gpu_ids is not None and len(gpu_ids) != tp_size:
            raise ValueError(f"SGLangServer: {len(gpu_ids)} gpu_ids for tp_size={tp_size}; give one GPU per TP rank")
        self.model_path = None if model_path is None else str(model_path)
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.tp_size = tp_size
        self.gpu_ids = None if gpu_ids is None else [int(g) for g in gpu_ids]
        self.mem_fraction_static = mem_fraction_static
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path is not None else Path(f"sglang_{self.port}.log")
        self._command = None if command is None else list(command)
        self.python = sglang_python(python)
        self.api_key = api_key or None
        self._key_config = KeyConfig(self.api_key) if self.api_key else None
        if self.api_key and "--config" in [*self.extra_args, *(self._command or [])]:
            raise ValueError("SGLangServer: the API key travels in SGLang's --config file; a launch with its own "
                             "--config cannot carry it as well (put the key into that file, or drop the key file)")
        self.cpu = cpu
        self._pump: RedactingPump | None = None
        self.process: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command_line(self) -> list[str]:
        """The launch command; with an API key it names the key's ``--config`` file (written here if
        :meth:`start` has not written it yet)."""
        key = []
        if self._key_config is not None:
            key = ["--config", str(self._key_config.path or self._key_config.write())]
        if self._command is not None:
            return [a.replace("{port}", str(self.port)).replace("{host}", self.host) for a in self._command] + key
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", str(self.model_path),
               "--host", self.host, "--port", str(self.port), "--tp-size", str(self.tp_size)]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        return cmd + (cpu_flags(self.extra_args) if self.cpu else []) + self.extra_args + key

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        return server_healthy(self.base_url, timeout)

    def start(self, timeout: float = 900.0, interval: float = 1.0) -> str:
        """Launch the server and wait until ``/health`` answers; returns the base URL."""
        if self.is_running():
            raise SGLangServerError(f"SGLangServer on port {self.port} is already running (pid {self.process.pid})")
        env = dict(os.environ, **(CPU_ENV if self.cpu else {}))
        if self.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpu_ids))
        try:
            self._launch(env)
            self._wait_healthy(timeout, interval)
        finally:
            if self._key_config is not None:  # read by the server at start-up: no longer on disk
                self._key_config.discard()
        return self.base_url

    def _launch(self, env: dict[str, str]) -> None:
        """Start the process (own session: stop() can end the server and every worker it forks, and only
        those); its output goes to the log, through a redacting pipe when there is a key."""
        if self._key_config is not None:
            self._key_config.write()
            self.process = launch(self.command_line(), subprocess.PIPE, env)
            self._pump = RedactingPump(self.process.stdout, self.log_path, self.api_key)
            return
        with open_private_log(self.log_path) as log:
            self.process = launch(self.command_line(), log, env)

    def _wait_healthy(self, timeout: float, interval: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy(timeout=interval):
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()  # its workers may still run
                if self._pump is not None:
                    self._pump.join(timeout=10)  # its last lines into the log before they are quoted
                raise SGLangServerError(startup_failure("SGLang", f"exited with code {code} during start-up",
                                                        self.log_path))
            if time.monotonic() > deadline:
                self.stop()
                raise SGLangServerError(startup_failure("SGLang", f"not healthy after {timeout:.0f} s (waited for "
                                                        f"GET {self.base_url}/health)", self.log_path))
            time.sleep(interval)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace`` seconds (what is left of it
        even when the server's main process already died); idempotent."""
        proc, self.process = self.process, None
        if proc is not None:
            end_group(proc, grace)

    def restart(self, timeout: float = 900.0) -> str:
        """Stop (if running) and start again on the same port; counts ``restarts``."""
        self.stop()
        self.restarts += 1
        return self.start(timeout=timeout)

    def __enter__(self) -> SGLangServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------
# an agent's servers (rollout.engine: sglang)


def start_engines(exp: ExperimentConfig, agent_cfg: AgentConfig, model: Any, tokenizer: Any,
                  root: Path, hf_config: Any = None,
                  trainer_placement: list[dict[str, Any]] | None = None) -> StartedEngines:
    """``rollout.engine: sglang`` (``rollout/launch.py``): put ``model`` (an HF model in this process, or
    an HF folder, linked rather than loaded: ``servers.engine_model_dir``) and ``tokenizer`` in
    ``root/init`` (the servers load it; also the config source of disk-sync folders), start the
    agent's servers on it (logs ``root/server<k>.log``) and return one client per server.
    ``hf_config``: the agent's transformers config (a CPU server is told the trainer's dtype).
    ``trainer_placement``: the agent's Ray ranks (per rank: node id, GPU ids), whose GPUs colocated
    servers with ``placement: ray`` share (rollout/engine_actor.colocated_shares)."""
    r, s = exp.rollout, exp.rollout.sglang
    api_key = read_api_key(s.api_key_file, "rollout.sglang.api_key_file")
    init_dir = engine_model_dir(model, tokenizer, root / "init")
    command = [a.replace("{model_path}", str(init_dir)) for a in s.command] or None
    extra = list(s.args)
    if r.colocate and MEMORY_SAVER_FLAG not in extra:
        extra.append(MEMORY_SAVER_FLAG)
    if s.cpu and not any(a.split("=", 1)[0] == "--dtype" for a in extra):
        # the trainer's dtype: SGLang's auto serves float32 checkpoints in 16 bits on CPU too, which the
        # post-sync check (1e-3 per token) refuses
        extra += ["--dtype", trainer_dtype(agent_cfg, model, hf_config)]
    groups = gpu_groups(agent_cfg.rollout_gpu_ids, s.tp, "rollout.sglang.tp")
    if s.placement == "ray":  # on the cluster's nodes, each owned by a Ray actor (rollout/engine_actor.py)
        from hacrl_megatron.rollout import engine_actor

        shares = engine_actor.colocated_shares(trainer_placement, s.tp, agent_cfg.name) if r.colocate else None
        kwargs = [dict(model_path=str(init_dir), tp_size=s.tp, mem_fraction_static=s.mem_fraction, extra_args=extra,
                       log_path=str(root / f"server{k}.log"), command=command,
                       python=None if command else s.python or None, api_key=api_key, cpu=s.cpu)
                  for k in range(len(shares if shares is not None else groups))]
        if shares is not None:  # on every node of the agent's trainer ranks, sharing their GPUs
            servers = engine_actor.start_colocated_servers(SGLangServer, kwargs, s.tp, shares, host=s.host)
        else:
            servers = engine_actor.start_remote_servers(SGLangServer, kwargs, s.tp, host=s.host, name=agent_cfg.name,
                                                        nodes=engine_actor.planned_nodes(groups, agent_cfg.name))
    else:
        servers = [SGLangServer(init_dir, tp_size=s.tp, gpu_ids=gpus, mem_fraction_static=s.mem_fraction,
                                extra_args=extra, log_path=root / f"server{k}.log", command=command,
                                python=None if command else s.python or None, api_key=api_key, cpu=s.cpu)
                   for k, gpus in enumerate(groups)]
        start_all(servers, "sglang")
    clients = [SGLangEngine(server.base_url, eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer, tp_size=s.tp,
                            server=server, name=f"engine{k}", api_key=api_key) for k, server in enumerate(servers)]
    return StartedEngines(clients, model_dir=init_dir)


def read_api_key(path: str, key: str) -> str | None:
    """The API key in the first line of ``path`` (None for ""); errors name the config ``key``."""
    if not path:
        return None
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{key}={path!r}: cannot read the API key file: {err}") from err
    secret = lines[0].strip() if lines else ""
    if not secret:
        raise ValueError(f"{key}={path!r}: the file's first line is empty; write the key there")
    return secret
