"""What every engine that runs as servers shares: one GPU group per server, starting them together,
launching a server process that dies with its starter and ending its whole process group, the client
side of a server's lifecycle (health, waiting for it, liveness, restart), and the folder the servers
load their starting weights from."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def gpu_groups(gpu_ids: list[int], tp: int, key: str = "tp") -> list[list[int] | None]:
    """One GPU list per server: consecutive groups of ``tp`` ids; ``[None]`` (inherit) when empty.
    ``key`` names the config field of ``tp`` in the error (``rollout.sglang.tp``, ``rollout.vllm.tp``)."""
    if not gpu_ids:
        return [None]
    if len(gpu_ids) % tp:
        raise ValueError(f"gpu_groups: {len(gpu_ids)} GPU ids are not a multiple of {key}={tp}")
    return [list(gpu_ids[k: k + tp]) for k in range(0, len(gpu_ids), tp)]


def start_all(servers: Sequence[Any], label: str = "server") -> None:
    """Start every server (``start()`` / ``stop()``) concurrently; if one fails, stop the others and re-raise.
    Inside :class:`StartTogether` (the same thread) it returns at once and the servers come up meanwhile."""
    group = StartTogether.active
    if group is not None and group.owner is threading.current_thread():
        group.add(servers, label)
        return
    with ThreadPoolExecutor(max_workers=len(servers), thread_name_prefix=f"{label}-start") as pool:
        futures = [pool.submit(s.start) for s in servers]
        errors = [f.exception() for f in futures]
    if any(errors):
        for s in servers:
            s.stop()
        raise next(e for e in errors if e is not None)


class StartTogether:
    """``with StartTogether(): ...``: every agent's servers start at once. :func:`start_all` called
    inside the block (by the thread that entered it) launches its servers in the background and returns,
    so the next agent is built while they come up; leaving the block waits for all of them. If one
    fails, every server started here is stopped and its error raised (the first, in start order); if
    the block itself fails, the starts are waited for (no server is left half-launched) and stopped."""

    active: StartTogether | None = None

    def __init__(self) -> None:
        self.owner = threading.current_thread()
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="server-start")
        self._started: list[tuple[Any, Any]] = []  # (server, future of its start())

    def add(self, servers: Sequence[Any], label: str) -> None:
        self._started += [(s, self._pool.submit(s.start)) for s in servers]

    def __enter__(self) -> StartTogether:
        if StartTogether.active is not None:
            raise RuntimeError("StartTogether blocks do not nest")
        StartTogether.active = self
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        StartTogether.active = None
        errors = [future.exception() for _, future in self._started]  # waits for every start
        self._pool.shutdown(wait=True)
        if exc is None and not any(errors):
            return
        for server, _ in self._started:
            server.stop()
        if exc is None:
            raise next(e for e in errors if e is not None)


GUARD = Path(__file__).with_name("server_guard.py")
ORPHAN_GRACE_S = 10.0  # a server whose trainer died: seconds from SIGTERM to SIGKILL (server_guard.py)


def guarded(command: Sequence[str], grace: float = ORPHAN_GRACE_S) -> list[str]:
    """``command`` run through ``server_guard.py``: the server's process group ends when this process
    dies (SIGTERM, SIGKILL after ``grace`` seconds), even by ``kill -9``."""
    return [sys.executable, "-I", str(GUARD), "--parent", str(os.getpid()), "--grace", str(grace), "--",
            *map(str, command)]


def launch(command: Sequence[str], log: Any, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a server: ``command`` (guarded) in its own session, stdout and stderr to the file ``log``.
    The returned process is the guard, leader of the group that :func:`end_group` ends."""
    return subprocess.Popen(guarded(command), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # nothing left in the group
        pass


def end_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """End the process group ``proc`` leads (a server started by :func:`launch`): SIGTERM, then
    SIGKILL after ``grace`` seconds. The SIGKILL goes to the group even when ``proc`` itself has
    already exited: a server killed by pid leaves its workers behind (vLLM's engine core)."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)  # start_new_session: the group id is the leader's pid
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait(timeout=grace)


ERROR_MARKERS = ("error", "exception", "assert", "traceback", "killed", "failed", "fatal")


def error_lines(path: Path, count: int = 8, chars: int = 4000) -> str:
    """The server's own last ``count`` error lines from its log (lines naming an error, an exception,
    an assertion, a failure), else its last ``count`` lines; or why there are none. A server's last
    line is often a pointer such as "See root cause above": the cause is the line this returns."""
    try:
        lines = [ln.rstrip() for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError as err:
        return f"(no log at {path}: {err.strerror})"
    if not lines:
        return f"(log {path} is empty)"
    errors = [ln for ln in lines if any(m in ln.lower() for m in ERROR_MARKERS)]
    picked = list(dict.fromkeys(reversed(errors or lines)))[:count][::-1]  # last ones, each once, in order
    return "\n".join(picked)[-chars:]


def startup_failure(kind: str, what: str, log_path: Path) -> str:
    """The message of a server that did not come up: ``what`` happened, its own error lines, its log."""
    return f"{kind} server {what}; its errors (log {log_path}):\n{error_lines(log_path)}"


def server_fault(err: BaseException) -> tuple[int, str] | None:
    """``(HTTP status, URL)`` when ``err`` was raised from a server's 5xx answer (the server is up but
    cannot serve: vLLM after its engine core died answers 500 to everything), else None. Engine
    clients raise their errors ``from`` urllib's ``HTTPError``, which is found on the cause chain."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, urllib.error.HTTPError) and seen.code >= 500:
            return seen.code, seen.url or ""
        seen = seen.__cause__ or seen.__context__
    return None


def server_log_errors(engine: Any, count: int = 6) -> str:
    """The last error lines of the log of the server behind ``engine`` when this process started it
    (a Ray-placed server's log is on its node: its path is named instead)."""
    server = getattr(engine, "server", None)
    path = getattr(server, "log_path", None)
    if path is None:
        return "(no server log in this process)"
    return error_lines(Path(path), count=count)


class ServerLifecycle:
    """Health, liveness and restart of an HTTP engine client (SGLang, vLLM). The client sets ``error``
    (its error class), ``kind`` (its engine's name in messages) and ``health_timeout_s``, and has
    ``_request(route, payload, method)``, ``base_url``, ``name``, ``server`` (the handle of a server this
    process started, or None) and ``restarts``."""

    error: type[Exception] = RuntimeError
    kind = "engine"
    health_timeout_s = 300.0

    def health(self) -> bool:
        """True when ``GET /health`` answers 200."""
        try:
            self._request("/health", None, "GET")
        except self.error:
            return False
        return True

    def wait_until_healthy(self, timeout: float | None = None, interval: float = 1.0) -> None:
        """Poll ``/health`` until it answers; raise ``error`` after ``timeout`` seconds (the client's default)."""
        timeout = self.health_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                raise self.error(f"{self.kind} server {self.base_url} not healthy after {timeout:.0f} s")
            time.sleep(interval)

    def alive(self) -> bool:
        """The server answers (and, if this process started it, its process is running)."""
        if self.server is not None and not self.server.is_running():
            return False
        return self.health()

    def restart(self) -> None:
        """Restart the server this process started (it comes back with its initial weights)."""
        if self.server is None:
            raise self.error(f"{self.kind} engine {self.name} ({self.base_url}): no server handle to restart")
        self.server.restart()
        self.restarts += 1


def engine_model_dir(model: Any, tokenizer: Any, init_dir: Path) -> Path:
    """The folder an agent's servers load at start: ``init_dir`` with ``tokenizer`` saved in it and
    the starting weights of ``model``, which is either an HF model in this process (saved, as its
    own dtype) or an HF folder on disk (every file of it linked, not copied: the servers read the
    weights in the dtype they were stored in, and nothing the size of the model is written or held
    here). The folder's own tokenizer files are not linked where the agent's tokenizer wrote its
    own (the agent's tokenizer defines its token ids). A linked folder must be on a filesystem every
    engine's node sees, as ``init_dir`` is."""
    if isinstance(model, (str, Path)):
        source = Path(model).resolve()
        if not (source / "config.json").is_file():
            raise FileNotFoundError(f"engine weights: {source} is not an HF model folder (no config.json)")
        if init_dir.is_symlink() or init_dir.is_file():
            init_dir.unlink()
        elif init_dir.exists():
            shutil.rmtree(init_dir)  # a previous attempt's folder: links from another source must not stay
        init_dir.mkdir(parents=True)
        tokenizer.save_pretrained(init_dir)  # first: a link must never be the path a save writes through
        for entry in sorted(source.iterdir()):
            if not (init_dir / entry.name).exists():
                (init_dir / entry.name).symlink_to(entry)
        return init_dir
    model.save_pretrained(init_dir)
    tokenizer.save_pretrained(init_dir)
    return init_dir


def model_hf_config(model: Any) -> Any:
    """The transformers config of an HF model in this process or of an HF folder (read, weights untouched;
    a run hands its engines the agent's config instead, read once: ``models/resolved.py``)."""
    if isinstance(model, (str, Path)):
        from hacrl_megatron.models.hf_io import read_hf_config

        return read_hf_config(model)
    return model.config


def trainer_dtype(agent_cfg: Any, model: Any, hf_config: Any = None) -> str:
    """The parameter dtype of ``agent_cfg``'s trainer, which its servers are told to serve in:
    ``model.dtype`` as a run resolved it (models/resolved.py), or, for a caller whose config still
    says ``auto``, resolved here against ``hf_config`` (read from ``model`` when None)."""
    from hacrl_megatron.config.schema import AUTO_DTYPE
    from hacrl_megatron.models.dtype import checkpoint_dtype, resolve_model_dtype

    if agent_cfg.model.dtype != AUTO_DTYPE:
        return agent_cfg.model.dtype
    config = hf_config if hf_config is not None else model_hf_config(model)
    return resolve_model_dtype(AUTO_DTYPE, checkpoint_dtype(config), backend=agent_cfg.backend)
