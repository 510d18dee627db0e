"""Symbolic answer checking with HF math-verify (optional backend, imported lazily).

math-verify parses LaTeX into sympy and compares symbolically (``\\frac12`` = ``0.5``,
``(x+1)^2`` = ``x^2+2x+1``, ``{1,2}`` = ``{2,1}``). It enforces its own time limits with
``signal.alarm``, which only works in a process's main thread; elsewhere those limits are switched
off here, and the caller must bound the time (the :class:`~hacrl_megatron.reward.pool.VerifierPool`
runs it in worker processes and kills a worker that overruns).

Before any symbolic work, :func:`looks_explosive` screens the text for inputs whose evaluation is
unbounded (huge exponents, power towers, huge factorials, thousands of digits, deep nesting); such
responses are never handed to sympy.
"""

from __future__ import annotations

import re
import threading

_BIG_EXPONENT_RE = re.compile(r"(?:\^|\*\*)\s*[{(]?\s*[-+]?\d{5,}")
_TOWER_RE = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\(?\s*\d+\s*\)?\s*\^|\*\*\s*\(?\s*[\w.]+\s*\)?\s*\*\*")
_BIG_FACTORIAL_RE = re.compile(r"\d{4,}\s*!")
_LONG_DIGITS_RE = re.compile(r"\d{1000,}")
MAX_NESTING = 64
MAX_SYMBOLIC_CHARS = 20_000


def _nesting_depth(text: str) -> int:
    depth = best = 0
    for ch in text:
        if ch in "({[":
            depth += 1
            best = max(best, depth)
        elif ch in ")}]":
            depth = max(0, depth - 1)
    return best


def looks_explosive(text: str) -> str | None:
    """Why ``text`` is unsafe to evaluate symbolically (a short reason), or None when it is safe.

    Flags: exponents of ≥ 5 digits (``10^{1000000}``), power towers (``9^{9^9}``, ``9**9**9``),
    factorials of ≥ 4-digit numbers, runs of ≥ 1000 digits, bracket nesting deeper than
    ``MAX_NESTING``, more than ``MAX_SYMBOLIC_CHARS`` characters.
    """
    if len(text) > MAX_SYMBOLIC_CHARS:
        return f"longer than {MAX_SYMBOLIC_CHARS} characters"
    for name, pattern in (
        ("huge exponent", _BIG_EXPONENT_RE),
        ("power tower", _TOWER_RE),
        ("huge factorial", _BIG_FACTORIAL_RE),
        ("huge numeral", _LONG_DIGITS_RE),
    ):
        if pattern.search(text):
            return name
    if _nesting_depth(text) > MAX_NESTING:
        return f"nesting deeper than {MAX_NESTING}"
    return None


def _import_math_verify():
    try:
        import math_verify
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "reward mode 'math_verify' needs the math-verify package: pip install 'math-verify>=0.7' "
            "(or pip install -e '.[data]')"
        ) from exc
    return math_verify


def math_verify_equal(response: str, reference: str, timeout_s: float = 5.0) -> bool:
    """math-verify's verdict on ``response`` (full text; last boxed answer preferred) vs ``reference``.

    The reference is read as LaTeX inside ``\\boxed{}``. ``timeout_s`` is math-verify's own limit per
    parse/verify call (whole seconds, rounded down, at least 1), active only in a main thread.
    """
    mv = _import_math_verify()
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    limit = max(1, int(timeout_s)) if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(
        "\\boxed{" + reference + "}",
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=limit,
    )
    if not gold:
        return False
    pred = mv.parse(response, parsing_timeout=limit)
    if not pred:
        return False
    return bool(mv.verify(gold, pred, timeout_seconds=limit))
