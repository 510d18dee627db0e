"""A process pool for the shared verifier with a hard per-item timeout (docs/architecture.md, reward/).

Why processes: math-verify enforces its limits with ``signal.alarm`` (main thread only), and some
inputs (a big-integer power, a pathological sympy expression) block inside one C call that no
signal interrupts. A worker process can always be killed. Each worker is a ``spawn``-ed process
(safe next to torch threads) fed one item at a time over its own pipe; the controller waits on
all pipes and process sentinels at once, so:

- an item that runs past ``timeout_s`` scores 0, is counted in ``timeouts``, and its worker is
  killed and replaced;
- a worker that dies (segfault, OOM kill, ``os._exit``) scores its item 0, is counted in
  ``errors``, and is replaced: a death at any moment costs at most the item it was scoring;
- a worker that dies or hangs while starting is replaced as well; only ``MAX_STARTUP_FAILURES``
  start-up failures in a row of one worker slot are fatal, and the error carries that worker's
  stderr (a broken environment fails fast; an OOM kill of a starting worker does not);
- math-verify's own alarm ("Timeout during comparison/parsing") scores the exact match alone and
  is counted in ``timeouts`` too;
- an exception inside scoring scores 0 and is counted in ``errors`` (the worker lives on);
- a response refused by a safety screen scores by the exact match only and is counted in ``guarded``.

The pool lives across calls (workers start once and are reused). ``num_workers=0`` scores in the
calling process: no hard timeout, but the same guards (length caps, the explosive-input screen
before math-verify, math-verify's own alarms in the main thread). A user's own checker (a
``score_fn`` with a ``user_code`` attribute, :class:`~hacrl_megatron.reward.custom.CustomScorer`)
always runs in worker processes (one when none is asked for), so ``timeout_s`` bounds user code
everywhere; when it answers none of ``MAX_USER_TIMEOUTS_IN_A_ROW`` items in a row (each one past the
timeout, or its worker ended by ``sys.exit`` or a crash) the pool raises :class:`UnresponsiveCheckerError`
naming it (a checker that never answers ends the run after about
``timeout_s × MAX_USER_TIMEOUTS_IN_A_ROW / num_workers`` seconds instead of scoring every response 0).

Leftovers: each worker leads its own session and carries a token in its environment; a worker that
is replaced or stopped takes with it every process of its group and every process that inherited the
token, so a checker that starts helpers (even ones that ``setsid`` away) leaves nothing running.

Usage::

    with VerifierPool(num_workers=2, timeout_s=5.0, mode="math") as pool:
        rewards = pool.score([RewardRequest("math", response, "\\\\frac{1}{2}"), ...])
        pool.stats  # {"scored": ..., "timeouts": ..., "errors": ..., "guarded": ..., "restarts": ...}
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import wait

from hacrl_megatron.errors import InputError, one_line_text
from hacrl_megatron.reward.math_verify_backend import math_verify_equal
from hacrl_megatron.reward.verify import MODES, RewardRequest, score_request_with_event

logger = logging.getLogger(__name__)

ScoreFn = Callable[[RewardRequest, str], float]
_READY = "ready"
MAX_STARTUP_FAILURES = 3  # start-up failures in a row of one worker slot before the pool gives up
# a worker that dies at start-up without a word is most often a script calling hacrl (cli.main, train) at its
# top level: spawned workers import the script again and run it, instead of starting
EMPTY_STDERR_HINT = ("\n(no output: if a Python script of yours starts hacrl, put that call under "
                     "`if __name__ == \"__main__\":`; worker processes are spawned, import the script again and "
                     "would run it instead of starting)")
MAX_USER_TIMEOUTS_IN_A_ROW = 4  # items a user's checker may leave unanswered in a row before the run stops
STDERR_TAIL_CHARS = 4000
_TOKEN_ENV = "HACRL_VERIFIER_WORKER"  # marks a worker's environment and so every process it starts


def enter_own_session(token: str) -> None:
    """In a child process about to run user code: lead a new session and mark the environment with
    ``token``, so that :func:`end_leftovers` finds whatever the code starts."""
    os.environ[_TOKEN_ENV] = token
    try:
        os.setsid()
    except OSError:  # already a group leader: the token still finds its descendants
        pass


def end_leftovers(groups: list[int], tokens: set[str]) -> None:
    """SIGKILL what stopped workers leave behind: the process groups they led, and every process whose
    environment carries one of their ``tokens`` (helpers that left the group with ``setsid``)."""
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:  # no such group any more (nothing left), or not ours
            pass
    marks = {f"{_TOKEN_ENV}={t}".encode() for t in tokens}
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:  # no /proc (not Linux): the groups are all that can be ended
        return
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
        except OSError:  # gone, or another user's process
            continue
        if env & marks:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


class UnresponsiveCheckerError(InputError):
    """A user's checker answered none of several items in a row within the timeout; names the checker."""


def _warm_up(mode: str) -> None:
    """Import the scoring backend before reporting ready, so start-up never eats an item's budget."""
    if mode == "math_verify":
        math_verify_equal("\\boxed{1}", "1")


def _score_one(
    request: RewardRequest, mode: str, score_fn: ScoreFn | None, timeout_s: float
) -> tuple[float, str | None, str]:
    """(score, event, error message) for one request; never raises.

    math-verify gets a third of the item budget per call (it makes up to three), so its own
    graceful timeout usually fires before the pool has to kill and respawn the worker.
    """
    try:
        if score_fn is None:
            value, event = score_request_with_event(request, mode, math_verify_timeout_s=timeout_s / 3)
        else:
            value, event = float(score_fn(request, mode)), None
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            return 0.0, "error", f"score {value!r} is outside [0, 1]"
        return value, event, ""
    except Exception as exc:  # any scoring failure is a 0 reward, counted, never a crash
        return 0.0, "error", one_line_text(f"{type(exc).__name__}: {exc}")


def _worker_main(conn, mode: str, score_blob: bytes | None, timeout_s: float, stderr_path: str, token: str) -> None:
    """Worker loop: receive (index, request), send (index, score, event, error); None stops it.

    Start-up (loading a custom scorer, importing the backend) writes its stderr to ``stderr_path``
    so that the controller can quote it if the start fails; scoring writes to the usual stderr.
    The worker leads a session of its own and marks its environment with ``token``: whatever its
    checker starts can be found and ended with it (:func:`end_leftovers`).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    enter_own_session(token)
    saved_stderr = os.dup(2)
    with open(stderr_path, "w") as capture:
        os.dup2(capture.fileno(), 2)
    score_fn = pickle.loads(score_blob) if score_blob is not None else None
    prepare = getattr(score_fn, "prepare", None)
    if prepare is not None:  # a user's checker imports now, under the start-up timeout, not an item's
        prepare()
    _warm_up(mode)
    sys.stderr.flush()
    os.dup2(saved_stderr, 2)
    os.close(saved_stderr)
    conn.send(_READY)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        index, request = msg
        conn.send((index, *_score_one(request, mode, score_fn, timeout_s)))


class _Worker:
    """Controller-side handle of one worker process."""

    def __init__(self, ctx, mode: str, score_blob: bytes | None, timeout_s: float) -> None:
        fd, self.stderr_path = tempfile.mkstemp(prefix="hacrl_verifier_", suffix=".stderr")
        os.close(fd)
        self.conn, child = ctx.Pipe(duplex=True)
        self.token = secrets.token_hex(8)
        self.process = ctx.Process(target=_worker_main, daemon=True,
                                   args=(child, mode, score_blob, timeout_s, self.stderr_path, self.token))
        self.process.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.item: int | None = None
        self.deadline = math.inf

    def mark_ready(self) -> None:
        self.ready = True
        self._drop_stderr()

    def stderr_tail(self) -> str:
        """The last ``STDERR_TAIL_CHARS`` characters its start-up wrote to stderr ('' if none)."""
        try:
            with open(self.stderr_path, errors="replace") as f:
                return f.read()[-STDERR_TAIL_CHARS:].strip()
        except OSError:
            return ""

    def exit_reason(self) -> str:
        code = self.process.exitcode
        if code is not None and code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def _drop_stderr(self) -> None:
        try:
            os.unlink(self.stderr_path)
        except OSError:
            pass

    def kill(self, leftovers: bool = True) -> None:
        """End the worker; with ``leftovers`` also everything it started (:func:`end_leftovers`)."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        if leftovers:
            end_leftovers([self.process.pid], {self.token})
        self.conn.close()
        self._drop_stderr()


class VerifierPool:
    """Score :class:`RewardRequest` batches in worker processes with a per-item timeout.

    Args:
        num_workers: worker processes (0: score in the calling process).
        timeout_s: wall-clock seconds one item may take in a worker before it scores 0.
        mode: ``"math"`` (paper's normalised exact match) or ``"math_verify"``.
        score_fn: optional picklable top-level callable ``(request, mode) -> float`` replacing the
            built-in scorer (custom verifiers; tests).
        start_method: multiprocessing start method, ``"spawn"`` or ``"forkserver"`` (fork is refused:
            unsafe with torch's threads).
        startup_timeout_s: seconds a new worker may take to import and warm up; a worker that takes
            longer counts as a failed start (replaced; ``MAX_STARTUP_FAILURES`` in a row are fatal).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        mode: str = "math",
        score_fn: ScoreFn | None = None,
        start_method: str = "spawn",
        startup_timeout_s: float = 120.0,
    ) -> None:
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be an int >= 0")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method={start_method!r} must be 'spawn' or 'forkserver'")
        self.user_code: str | None = getattr(score_fn, "user_code", None)
        if self.user_code and num_workers == 0:
            num_workers = 1  # in-process scoring has no hard timeout: user code always gets a worker
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.mode = mode
        self.startup_timeout_s = float(startup_timeout_s)
        # pickled here, loaded by the worker after its stderr capture starts: a scorer whose module
        # fails to import in a fresh process is reported with its traceback
        self._score_blob = pickle.dumps(score_fn) if score_fn is not None else None
        self._score_fn = score_fn
        self._ctx = mp.get_context(start_method)
        self._stats = {"scored": 0, "timeouts": 0, "errors": 0, "guarded": 0, "restarts": 0}
        self._closed = False
        self._startup_failures = [0] * num_workers
        self._user_timeouts_in_a_row = 0
        self._workers: list[_Worker] = [self._new_worker() for _ in range(num_workers)]

    # -- public API ---------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, int]:
        """Counters since creation: scored (normally), timeouts, errors, guarded, restarts."""
        return dict(self._stats)

    @property
    def worker_pids(self) -> list[int]:
        """PIDs of the current worker processes (they change when a worker is replaced)."""
        return [w.process.pid for w in self._workers]

    def score(self, requests: list[RewardRequest]) -> list[float]:
        """One reward in [0, 1] per request, in order. Never raises for a bad response."""
        if self._closed:
            raise RuntimeError("VerifierPool.score called after close()")
        for i, r in enumerate(requests):
            if not isinstance(r, RewardRequest):
                raise TypeError(f"requests[{i}] must be a RewardRequest, got {type(r).__name__}")
        if self.num_workers == 0:
            return [self._record(*_score_one(r, self.mode, self._score_fn, self.timeout_s)) for r in requests]
        return self._score_in_workers(requests)

    def wait_ready(self) -> None:
        """Block until every worker has started (replacing workers whose start fails, as
        :meth:`score` does). Raises RuntimeError after ``MAX_STARTUP_FAILURES`` failed starts in a
        row of one worker. No-op with ``num_workers=0``."""
        if self._closed:
            raise RuntimeError("VerifierPool.wait_ready called after close()")
        while not all(w.ready for w in self._workers):
            self._wait_and_poll([])

    def close(self) -> None:
        """Stop the workers (politely, then by force). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            if w.ready:  # a worker still importing would not read the stop message soon
                w.process.join(timeout=0.5)
            w.kill(leftovers=False)
        end_leftovers([w.process.pid for w in self._workers], {w.token for w in self._workers})  # one /proc scan
        self._workers = []

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- internals ----------------------------------------------------------------------------
    def _new_worker(self) -> _Worker:
        return _Worker(self._ctx, self.mode, self._score_blob, self.timeout_s)

    def _record(self, value: float, event: str | None, error: str) -> float:
        if event == "error":
            self._stats["errors"] += 1
            logger.warning("verifier error (scored 0): %s", error)
        elif event == "timeout":  # math-verify's own alarm fired inside the scorer
            self._stats["timeouts"] += 1
        else:
            self._stats["scored"] += 1
            if event == "guarded":
                self._stats["guarded"] += 1
        return value

    def _replace(self, slot: int) -> None:
        self._workers[slot].kill()
        self._workers[slot] = self._new_worker()
        self._stats["restarts"] += 1

    def _dispatch(self, requests: list[RewardRequest], pending: deque) -> None:
        """Send the next pending item to every ready, idle worker."""
        for slot, w in enumerate(self._workers):
            if not (w.ready and w.item is None and pending):
                continue
            index = pending.popleft()
            try:
                w.conn.send((index, requests[index]))
            except (OSError, ValueError):  # worker died while idle: replace, retry the item
                pending.appendleft(index)
                self._replace(slot)
                continue
            w.item, w.deadline = index, time.monotonic() + self.timeout_s

    def _score_in_workers(self, requests: list[RewardRequest]) -> list[float]:
        results: list[float | None] = [None] * len(requests)
        pending = deque(range(len(requests)))
        while pending or any(w.item is not None for w in self._workers):
            self._dispatch(requests, pending)
            self._wait_and_poll(results)
        return [float(r) for r in results]

    def _wait_and_poll(self, results: list) -> None:
        """Wait for any worker's message, death or deadline, then handle every worker once."""
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.item is not None]
        deadlines += [w.started + self.startup_timeout_s for w in self._workers if not w.ready]
        timeout = max(0.0, min(deadlines, default=now + 1.0) - now)
        handles = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
        wait(handles, timeout=timeout)
        for slot in range(len(self._workers)):
            self._poll(slot, results)

    def _poll(self, slot: int, results: list) -> None:
        """Collect a worker's message, or handle its death, overrun or failed start-up."""
        w = self._workers[slot]
        try:
            has_msg = w.conn.poll()
            msg = w.conn.recv() if has_msg else None
        except (EOFError, OSError):
            has_msg, msg = False, None
        if has_msg and msg == _READY:
            w.mark_ready()
            self._startup_failures[slot] = 0
            return
        if has_msg:
            index, value, event, error = msg
            results[index] = self._record(value, event, error)
            w.item, w.deadline = None, math.inf
            self._user_timeouts_in_a_row = 0
            return
        now = time.monotonic()
        if not w.process.is_alive():
            self._on_dead(slot, results)
        elif w.item is not None and now >= w.deadline:
            logger.warning(
                "verifier item %d ran past %.1fs: scored 0, worker replaced", w.item, self.timeout_s
            )
            results[w.item] = 0.0
            self._stats["timeouts"] += 1
            self._replace(slot)
            self._check_user_code_answers()
        elif not w.ready and now >= w.started + self.startup_timeout_s:
            self._failed_start(slot, f"did not start within {self.startup_timeout_s:.0f}s")

    def _check_user_code_answers(self, death: str | None = None) -> None:
        """After a timeout, or a worker's ``death`` on an item (``sys.exit`` or a crash in the checker):
        stop when a user's checker has now left too many items in a row unanswered."""
        if not self.user_code:
            return
        self._user_timeouts_in_a_row += 1
        n = self._user_timeouts_in_a_row
        if n >= MAX_USER_TIMEOUTS_IN_A_ROW and death is None:
            raise UnresponsiveCheckerError(
                f"{self.user_code} answered none of the last {n} responses within the verifier's timeout "
                f"({self.timeout_s:g} s each): a checker must return a reward in bounded time; stopped")
        if n >= MAX_USER_TIMEOUTS_IN_A_ROW:
            raise UnresponsiveCheckerError(
                f"{self.user_code} answered none of the last {n} responses: its worker process {death} on the "
                "last one (sys.exit, os._exit or a crash inside the checker); a checker must return a reward "
                "and leave its process running; stopped")

    def _failed_start(self, slot: int, what: str) -> None:
        """Replace a worker that failed to start; the ``MAX_STARTUP_FAILURES``-th failure in a row
        of this slot raises RuntimeError with the worker's start-up stderr."""
        w = self._workers[slot]
        self._startup_failures[slot] += 1
        failures = self._startup_failures[slot]
        if failures >= MAX_STARTUP_FAILURES:
            stderr = w.stderr_tail()
            w.kill()
            raise RuntimeError(
                f"verifier worker {slot} failed to start {failures} times in a row (last one {what}); "
                "check that hacrl_megatron, the reward backend and any custom scorer import in a fresh "
                f"process. Its stderr:\n{stderr or '(empty)'}" + ("" if stderr else EMPTY_STDERR_HINT)
            )
        logger.warning("verifier worker %d %s during start-up (failure %d of %d in a row): starting another",
                       slot, what, failures, MAX_STARTUP_FAILURES)
        self._replace(slot)

    def _on_dead(self, slot: int, results: list) -> None:
        w = self._workers[slot]
        if not w.ready:
            self._failed_start(slot, w.exit_reason())
            return
        died_on_item = w.item is not None
        if died_on_item:
            logger.warning("verifier worker died (exit %s) on item %d: scored 0", w.process.exitcode, w.item)
            results[w.item] = 0.0
            self._stats["errors"] += 1
        reason = w.exit_reason()
        self._replace(slot)
        if died_on_item:  # sys.exit or a crash inside the checker: as unanswered as a timeout
            self._check_user_code_answers(death=reason)
