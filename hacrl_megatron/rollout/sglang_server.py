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
while the trainer trains. Standard library only.
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
from hacrl_megatron.rollout.servers import (
    end_group,
    engine_model_dir,
    gpu_groups,
    launch,
    start_all,
    startup_failure,
)
from hacrl_megatron.rollout.sglang_engine import SGLangEngine

if TYPE_CHECKING:
    from hacrl_megatron.config import AgentConfig, ExperimentConfig

SGLANG_PYTHON_ENV = "HACRL_SGLANG_PYTHON"  # same variable as hacrl_megatron.config.SGLANG_PYTHON_ENV
MEMORY_SAVER_FLAG = "--enable-memory-saver"


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
        api_key: SGLang's ``--api-key`` (appended to the command line, a custom one too): the server
            then refuses every request but ``/health`` without ``Authorization: Bearer <key>``.
            It is visible in the process list of the server's node, as any launch flag.
    """

    def __init__(self, model_path: str | os.PathLike | None, *, host: str = "127.0.0.1", port: int | None = None,
                 tp_size: int = 1, gpu_ids: Sequence[int] | None = None, mem_fraction_static: float | None = None,
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike | None = None,
                 command: Sequence[str] | None = None, python: str | os.PathLike | None = None,
                 api_key: str | None = None) -> None:
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
        self.process: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command_line(self) -> list[str]:
        key = ["--api-key", self.api_key] if self.api_key else []
        if self._command is not None:
            return [a.replace("{port}", str(self.port)).replace("{host}", self.host) for a in self._command] + key
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", str(self.model_path),
               "--host", self.host, "--port", str(self.port), "--tp-size", str(self.tp_size)]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        return cmd + self.extra_args + key

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        return server_healthy(self.base_url, timeout)

    def start(self, timeout: float = 900.0, interval: float = 1.0) -> str:
        """Launch the server and wait until ``/health`` answers; returns the base URL."""
        if self.is_running():
            raise SGLangServerError(f"SGLangServer on port {self.port} is already running (pid {self.process.pid})")
        env = dict(os.environ)
        if self.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpu_ids))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            # own session: stop() can end the server and every worker it forks, and only those
            self.process = launch(self.command_line(), log, env)
        deadline = time.monotonic() + timeout
        while not self.healthy(timeout=interval):
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()  # its workers may still run
                raise SGLangServerError(startup_failure("SGLang", f"exited with code {code} during start-up",
                                                        self.log_path))
            if time.monotonic() > deadline:
                self.stop()
                raise SGLangServerError(startup_failure("SGLang", f"not healthy after {timeout:.0f} s (waited for "
                                                        f"GET {self.base_url}/health)", self.log_path))
            time.sleep(interval)
        return self.base_url

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
                  root: Path) -> StartedEngines:
    """``rollout.engine: sglang`` (``rollout/launch.py``): put ``model`` (an HF model in this process, or
    an HF folder, linked rather than loaded: ``servers.engine_model_dir``) and ``tokenizer`` in
    ``root/init`` (the servers load it; also the config source of disk-sync folders), start the
    agent's servers on it (logs ``root/server<k>.log``) and return one client per server."""
    r, s = exp.rollout, exp.rollout.sglang
    api_key = read_api_key(s.api_key_file, "rollout.sglang.api_key_file")
    init_dir = engine_model_dir(model, tokenizer, root / "init")
    command = [a.replace("{model_path}", str(init_dir)) for a in s.command] or None
    extra = list(s.args)
    if r.colocate and MEMORY_SAVER_FLAG not in extra:
        extra.append(MEMORY_SAVER_FLAG)
    groups = gpu_groups(agent_cfg.rollout_gpu_ids, s.tp, "rollout.sglang.tp")
    if s.placement == "ray":  # on the cluster's nodes, each owned by a Ray actor (rollout/engine_actor.py)
        from hacrl_megatron.rollout.engine_actor import planned_nodes, start_remote_servers

        kwargs = [dict(model_path=str(init_dir), tp_size=s.tp, mem_fraction_static=s.mem_fraction, extra_args=extra,
                       log_path=str(root / f"server{k}.log"), command=command,
                       python=None if command else s.python or None, api_key=api_key) for k in range(len(groups))]
        servers = start_remote_servers(SGLangServer, kwargs, s.tp, host=s.host,
                                       nodes=planned_nodes(groups, agent_cfg.name))
    else:
        servers = [SGLangServer(init_dir, tp_size=s.tp, gpu_ids=gpus, mem_fraction_static=s.mem_fraction,
                                extra_args=extra, log_path=root / f"server{k}.log", command=command,
                                python=None if command else s.python or None, api_key=api_key)
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
