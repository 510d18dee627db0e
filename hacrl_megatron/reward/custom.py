"""A user's own verifier, plugged in by configuration (``data.checker``, ``hacrl eval --checker``).

A checker is a plain function of one of two signatures, told apart by its parameter names:

- ``checker(response: str, reference: str) -> float``: ``reference`` is the record's ``answer``;
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` returning a
  number or a dict with a ``"score"``: ``data_source``, ``ground_truth`` and ``extra_info`` come
  from the row of a verl-layout dataset (``data_source``, ``reward_model.ground_truth``,
  ``extra_info``; ``data_source`` is ``"custom"`` and ``extra_info`` None for other rows).

Its reward lies in ``data.reward_range`` [low, high] (default [0, 1]); it is mapped to
(R − low) / (high − low) ∈ [0, 1] before anything uses it, so a response counts as solved for the
capability tracker's positive rate (eq. 7-8: normalised reward > 0) exactly when its reward is above
``low``: declare ``low`` as the reward of a wrong answer. It is named by a spec string:

- ``"package.module:function"`` — an importable module (on ``sys.path`` / ``PYTHONPATH``);
- ``"path/to/checker.py:function"`` — a Python file, relative to the current directory.

The spec is checked when the run starts (:func:`check_checker`: the module imports, the name exists,
is callable and takes two positional arguments), so a typo fails before any model is built with an
error naming ``data.checker``. That check imports the user's module in a child process bounded by
:data:`IMPORT_TIMEOUT_S`, so a module that blocks at import stops the run with one line instead of
hanging it; the controller itself never runs user code. The verifier's worker processes load the
function from the same spec (:class:`CustomScorer` pickles the spec, never the function) while they
start, and every call keeps the pool's guarantees: an exception or a value outside the range scores 0
and is counted, a hang is killed at the per-item timeout, and a checker that answers none of several
responses in a row stops the run naming it (:class:`~hacrl_megatron.reward.pool.VerifierPool` runs
user code in a worker process even when asked for none, so the timeout holds everywhere: warm-up,
evaluation, RL). See ``examples/custom_task``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import multiprocessing as mp
import os
import re
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hacrl_megatron.errors import InputError
from hacrl_megatron.reward.verify import RewardRequest

Checker = Callable[..., float]
VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth")  # verl's compute_score, in this order
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_loaded: dict[str, Checker] = {}  # spec -> function, per process (workers load once)
_checked: set[str] = set()  # specs whose import was checked in a child process (by this process)
IMPORT_TIMEOUT_S = 60.0  # seconds the user's module may take to import (and be checked) in the child


class CheckerError(InputError):
    """A ``data.checker`` spec that cannot be used; the message names the spec and the reason."""


@dataclass(frozen=True)
class CheckerSpec:
    """A parsed spec: ``target`` is a module name or a ``.py`` file path, ``function`` the attribute."""

    target: str
    function: str
    is_file: bool


def parse_checker_spec(spec: str, field: str = "data.checker") -> CheckerSpec:
    """Split ``"module:function"`` / ``"file.py:function"`` (pure: no import, no file access)."""
    rule = "must be 'package.module:function' or 'path/to/file.py:function'"
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise CheckerError(f"{field}={spec!r}: {rule}")
    target, function = spec.rsplit(":", 1)
    target, function = target.strip(), function.strip()
    if not function.isidentifier():
        raise CheckerError(f"{field}={spec!r}: {function!r} is not a function name; {rule}")
    is_file = target.endswith(".py")
    if not target or (not is_file and not _MODULE_RE.match(target)):
        raise CheckerError(f"{field}={spec!r}: {target!r} is neither a module name nor a .py file; {rule}")
    return CheckerSpec(target, function, is_file)


def _import_file(path: Path, field: str, spec: str):
    # a stable module name per file, so two checkers called check.py never collide
    name = "hacrl_user_checker_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise CheckerError(f"{field}={spec!r}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise CheckerError(f"{field}={spec!r}: importing {path} failed: {type(err).__name__}: {err}") from None
    return module


def _import_target(parsed: CheckerSpec, field: str, spec: str):
    if parsed.is_file:
        path = Path(parsed.target).expanduser().resolve()
        if not path.is_file():
            raise CheckerError(f"{field}={spec!r}: no such file {path} (relative paths start at {os.getcwd()})")
        return _import_file(path, field, spec)
    try:
        return importlib.import_module(parsed.target)
    except ModuleNotFoundError as err:
        raise CheckerError(f"{field}={spec!r}: module {parsed.target!r} not found ({err}); put its folder on "
                           "PYTHONPATH or name the file instead: 'path/to/file.py:function'") from None
    except Exception as err:
        raise CheckerError(f"{field}={spec!r}: importing {parsed.target!r} failed: {type(err).__name__}: {err}") from None


def load_checker(spec: str, field: str = "data.checker") -> Checker:
    """The checker function named by ``spec``, imported and checked; cached per process.

    Raises :class:`CheckerError` naming ``field`` and ``spec`` when the module or file does not
    import, the name is missing or not callable, or it cannot be called as ``f(response, reference)``.
    """
    if spec in _loaded:
        return _loaded[spec]
    parsed = parse_checker_spec(spec, field)
    module = _import_target(parsed, field, spec)
    fn = getattr(module, parsed.function, None)
    if fn is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
        raise CheckerError(f"{field}={spec!r}: {parsed.target} has no {parsed.function!r}; its callables: {public}")
    if not callable(fn):
        raise CheckerError(f"{field}={spec!r}: {parsed.function!r} is a {type(fn).__name__}, not a function")
    try:
        if is_verl_style(fn):
            inspect.signature(fn).bind("source", "response", "reference", None)
        else:
            inspect.signature(fn).bind("response", "reference")
    except TypeError as err:
        raise CheckerError(f"{field}={spec!r}: must accept two positional arguments (response, reference), or be "
                           f"verl's compute_score(data_source, solution_str, ground_truth, extra_info=None): {err}") from None
    except ValueError:  # builtins without a signature: trust them
        pass
    _loaded[spec] = fn
    return fn


def is_verl_style(fn: Callable) -> bool:
    """Whether ``fn``'s first parameters are verl's ``(data_source, solution_str, ground_truth)``."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(names[:3]) == VERL_PARAMETERS


def call_checker(fn: Callable, request: RewardRequest) -> float:
    """The raw reward of ``fn`` (either signature, see the module) for ``request``; a verl dict's ``"score"``."""
    if is_verl_style(fn):
        extra = json.loads(request.extra) if request.extra else None
        value = fn(request.source or "custom", request.response, request.reference, extra)
    else:
        value = fn(request.response, request.reference)
    if isinstance(value, dict):  # verl reward functions may return {"score": ..., "acc": ..., ...}
        if "score" not in value:
            raise ValueError(f"the checker returned a dict without 'score' (keys {sorted(value)})")
        value = value["score"]
    return float(value)


def _check_in_child(spec: str, field: str, conn, token: str) -> None:
    """Child side of :func:`check_checker`: load the checker, send '' or the reason it cannot be used.
    It runs in a session of its own, marked with ``token``: what the module starts ends with it."""
    from hacrl_megatron.reward.pool import enter_own_session

    enter_own_session(token)
    try:
        load_checker(spec, field)
        conn.send("")
    except CheckerError as err:
        conn.send(str(err))
    except BaseException as err:  # SystemExit or KeyboardInterrupt raised by the user's module
        conn.send(f"{field}={spec!r}: importing it raised {type(err).__name__}: {err}")


def check_checker(spec: str, field: str = "data.checker", timeout_s: float | None = None) -> str:
    """Check that ``spec`` names a usable checker, importing it in a child process; returns the spec
    with a file path made absolute (what worker processes load).

    The import is bounded by ``timeout_s`` (default :data:`IMPORT_TIMEOUT_S`): a module that blocks
    at import (a network call, a lock, ``time.sleep``) raises :class:`CheckerError` naming ``field``
    and the spec. Checked specs are remembered for the life of this process.
    """
    parsed = parse_checker_spec(spec, field)
    given = spec  # messages name the value as the user wrote it; workers load the absolute path
    if parsed.is_file:
        spec = f"{Path(parsed.target).expanduser().resolve()}:{parsed.function}"
    if spec in _checked:
        return spec
    limit = IMPORT_TIMEOUT_S if timeout_s is None else timeout_s
    from hacrl_megatron.reward.pool import end_leftovers

    ctx = mp.get_context("spawn")  # safe next to torch's threads; the child starts from a clean state
    parent, child = ctx.Pipe(duplex=False)
    token = secrets.token_hex(8)
    proc = ctx.Process(target=_check_in_child, args=(spec, field, child, token), daemon=True)
    proc.start()
    child.close()
    try:
        answered = parent.poll(limit)
        reason = parent.recv() if answered else None
    except EOFError:
        answered, reason = True, f"{field}={spec!r}: checking it killed the process (exit code {proc.exitcode})"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        end_leftovers([proc.pid], {token})  # helpers its import started, also ones that left with setsid
        parent.close()
    if not answered:
        raise CheckerError(f"{field}={given!r}: importing it did not finish within {limit:g} s; a checker module "
                           "must import without waiting on anything (check what it does at import time)")
    if reason:
        raise CheckerError(reason.replace(f"{field}={spec!r}", f"{field}={given!r}"))
    _checked.add(spec)
    return spec


@dataclass(frozen=True)
class CustomScorer:
    """A :class:`~hacrl_megatron.reward.pool.VerifierPool` ``score_fn`` calling a user checker.

    Picklable: it carries the spec (file paths made absolute, so worker processes resolve the same
    file), and each process loads the function once (:meth:`prepare`, while a worker starts).
    ``mode`` (the built-in verifier's mode) is not passed on: the checker defines the whole reward.
    """

    spec: str
    field: str = "data.checker"
    reward_range: tuple[float, float] = (0.0, 1.0)  # data.reward_range: [low, high] of the raw reward

    @classmethod
    def from_spec(cls, spec: str, field: str = "data.checker",
                  reward_range: tuple[float, float] = (0.0, 1.0)) -> CustomScorer:
        """Checked first (:func:`check_checker`, in a child process), so errors surface before any work."""
        return cls(check_checker(spec, field), field, (float(reward_range[0]), float(reward_range[1])))

    @property
    def user_code(self) -> str:
        """What runs user code, for messages: ``data.checker='/abs/check.py:score'``. The pool reads it
        to keep user code in worker processes under its timeout."""
        return f"{self.field}={self.spec!r}"

    def prepare(self) -> None:
        """Import the checker now (a worker calls this during its start-up, not on its first item)."""
        load_checker(self.spec, self.field)

    def __call__(self, request: RewardRequest, mode: str) -> float:
        """The checker's reward mapped from ``reward_range`` onto [0, 1]; ValueError (the pool scores 0 and
        counts an error) for a value that is not a finite number in the range."""
        value = call_checker(load_checker(self.spec), request)
        low, high = self.reward_range
        if not (math.isfinite(value) and low <= value <= high):
            raise ValueError(f"score {value!r} is outside data.reward_range [{low:g}, {high:g}]")
        return (value - low) / (high - low)


def custom_score_fn(spec: str | None, field: str = "data.checker",
                    reward_range: tuple[float, float] | list[float] = (0.0, 1.0)) -> CustomScorer | None:
    """The pool's ``score_fn`` for an optional spec: None keeps the built-in verifier."""
    return None if spec is None else CustomScorer.from_spec(spec, field, tuple(reward_range))
