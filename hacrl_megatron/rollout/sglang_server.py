"""Start, health-check, restart and stop one SGLang server per agent partition (GPU clusters).

``SGLangServer(model_path, gpu_ids=[0, 1], tp_size=2).start()`` runs
``python -m sglang.launch_server --model-path ... --host 127.0.0.1 --port P --tp-size 2`` with
``CUDA_VISIBLE_DEVICES=0,1`` in its own session, waits for ``/health`` and returns the base URL for
:class:`~hacrl_megatron.rollout.SGLangEngine`. ``stop()`` ends exactly the process group it
started (SIGTERM, then SIGKILL after a grace period) — never other processes. Standard library only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from hacrl_megatron.net import free_port

SGLANG_PYTHON_ENV = "HACRL_SGLANG_PYTHON"  # same variable as hacrl_megatron.config.SGLANG_PYTHON_ENV



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
            environment, config ``rollout.sglang_python``); None: ``$HACRL_SGLANG_PYTHON`` (the
            container image sets it to its SGLang venv) if set, else this process's ``sys.executable``.
    """

    def __init__(self, model_path: str | os.PathLike | None, *, host: str = "127.0.0.1", port: int | None = None,
                 tp_size: int = 1, gpu_ids: Sequence[int] | None = None, mem_fraction_static: float | None = None,
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike | None = None,
                 command: Sequence[str] | None = None, python: str | os.PathLike | None = None) -> None:
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
        self.python = str(python) if python else os.environ.get(SGLANG_PYTHON_ENV) or sys.executable
        self.process: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command_line(self) -> list[str]:
        if self._command is not None:
            return [a.replace("{port}", str(self.port)).replace("{host}", self.host) for a in self._command]
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", str(self.model_path),
               "--host", self.host, "--port", str(self.port), "--tp-size", str(self.tp_size)]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        return cmd + self.extra_args

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        return server_healthy(self.base_url, timeout)

    def _log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

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
            self.process = subprocess.Popen(self.command_line(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.healthy(timeout=interval):
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise SGLangServerError(f"SGLang server exited with code {code} during start-up; "
                                        f"log {self.log_path}:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise SGLangServerError(f"SGLang server not healthy after {timeout:.0f} s; "
                                        f"log {self.log_path}:\n{self._log_tail()}")
            time.sleep(interval)
        return self.base_url

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace`` seconds; idempotent."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the group this object created (start_new_session)
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace)
        except ProcessLookupError:
            pass

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
