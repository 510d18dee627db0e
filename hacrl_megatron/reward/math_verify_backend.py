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

import threading

MAX_NESTING = 64
MAX_SYMBOLIC_CHARS = 20_000
MIN_EXPONENT_DIGITS = 5  # ^{12345}: 5 digits
MIN_FACTORIAL_DIGITS = 4  # 1234!
MIN_NUMERAL_DIGITS = 1000

# The screen is a set of hand-written scans, each O(len(text)): regular expressions with adjacent
# unbounded repeats (``\d{4,}\s*!``, ``\s*\(?\s*[\w.]+\s*\)?\s*\*\*``) backtrack quadratically or worse
# on long digit or blank runs (a 20k-digit answer took ~5 s; 5k blanks after ``** `` several
# minutes), and the screen runs on untrusted model output before any time limit applies.


def _skip_blanks(text: str, i: int, n: int) -> int:
    while i < n and text[i].isspace():
        i += 1
    return i


def _skip_digits(text: str, i: int, n: int) -> int:
    while i < n and text[i].isdecimal():
        i += 1
    return i


def _skip_word(text: str, i: int, n: int) -> int:
    r"""End of a run of word characters and dots (``[\w.]+``)."""
    while i < n and (text[i].isalnum() or text[i] in "_."):
        i += 1
    return i


def _power_at(text: str, i: int, n: int) -> int:
    """Index after the power operator (``^`` or ``**``) starting at ``i``, or -1 when there is none."""
    if text[i] == "^":
        return i + 1
    if text[i] == "*" and i + 1 < n and text[i + 1] == "*":
        return i + 2
    return -1


def _has_huge_exponent(text: str, n: int) -> bool:
    """``^`` / ``**``, blanks, an optional ``{`` or ``(``, an optional sign, then ≥ 5 digits.

    Each operator's scan covers only blanks, one bracket, a sign and digits (no operator), so the
    scans of different operators never overlap: O(n) in all.
    """
    for i in range(n):
        j = _power_at(text, i, n)
        if j < 0:
            continue
        k = _skip_blanks(text, j, n)
        if k < n and text[k] in "{(":
            k = _skip_blanks(text, k + 1, n)
        if k < n and text[k] in "+-":
            k += 1
        if _skip_digits(text, k, n) - k >= MIN_EXPONENT_DIGITS:
            return True
    return False


def _operand_then_power(text: str, k: int, n: int, operand, closing: str) -> bool:
    """From ``k``: blanks, optional ``(``, blanks, an operand run, blanks, optional ``)``, blanks, then
    the operator ``closing`` (``^`` or ``**``)."""
    k = _skip_blanks(text, k, n)
    if k < n and text[k] == "(":
        k = _skip_blanks(text, k + 1, n)
    end = operand(text, k, n)
    if end == k:
        return False
    k = _skip_blanks(text, end, n)
    if k < n and text[k] == ")":
        k = _skip_blanks(text, k + 1, n)
    return text[k:k + len(closing)] == closing


def _has_power_tower(text: str, n: int) -> bool:
    """``^{...^`` (another power inside a braced exponent), ``a^b^c`` / ``a^(b)^c`` with a numeric
    middle, or ``a**b**c`` / ``a**(b)**c`` with a word or number in the middle.

    Every scan stops at the next operator of its kind or at a brace, so each character is visited
    by at most one scan per rule: O(n).
    """
    for i in range(n):
        if text[i] == "^":
            k = _skip_blanks(text, i + 1, n)
            if k < n and text[k] == "{":
                m = k + 1
                while m < n and text[m] not in "{}^":
                    m += 1
                if m < n and text[m] == "^":
                    return True
            if _operand_then_power(text, i + 1, n, _skip_digits, "^"):
                return True
        elif text[i] == "*" and i + 1 < n and text[i + 1] == "*":
            if _operand_then_power(text, i + 2, n, _skip_word, "**"):
                return True
    return False


def _digit_runs(text: str, n: int) -> tuple[bool, bool]:
    """(a run of ≥ 4 digits followed by blanks and ``!``, a run of ≥ 1000 digits), in one pass."""
    factorial = numeral = False
    i = 0
    while i < n:
        if not text[i].isdecimal():
            i += 1
            continue
        end = _skip_digits(text, i, n)
        length = end - i
        numeral = numeral or length >= MIN_NUMERAL_DIGITS
        if length >= MIN_FACTORIAL_DIGITS:
            k = _skip_blanks(text, end, n)  # blanks belong to this run only: still one pass
            factorial = factorial or (k < n and text[k] == "!")
        i = end
    return factorial, numeral


def _nesting_depth(text: str) -> int:
    depth = best = 0
    for i in range(len(text)):
        ch = text[i]
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
    ``MAX_NESTING``, more than ``MAX_SYMBOLIC_CHARS`` characters. Linear time: a handful of
    passes over the text, no backtracking.
    """
    n = len(text)
    if n > MAX_SYMBOLIC_CHARS:
        return f"longer than {MAX_SYMBOLIC_CHARS} characters"
    if _has_huge_exponent(text, n):
        return "huge exponent"
    if _has_power_tower(text, n):
        return "power tower"
    factorial, numeral = _digit_runs(text, n)
    if factorial:
        return "huge factorial"
    if numeral:
        return "huge numeral"
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


def math_verify_verdict(response: str, reference: str, timeout_s: float = 5.0) -> tuple[bool, bool]:
    """(equal, timed out): math-verify's verdict on ``response`` (full text; last boxed answer
    preferred) vs ``reference``, and whether one of its own alarms fired on the way.

    The reference is read as LaTeX inside ``\\boxed{}``. ``timeout_s`` is math-verify's own limit per
    parse/verify call (whole seconds, rounded down, at least 1), active only in a main thread.
    math-verify swallows its alarms ("Timeout during parsing/comparison" warnings, verdict False);
    here they are caught so the caller can count them as timeouts. Other errors inside math-verify
    still mean "not equal", as in math-verify itself.
    """
    mv = _import_math_verify()
    from math_verify import ExprExtractionConfig, LatexExtractionConfig
    from math_verify.errors import TimeoutException

    limit = max(1, int(timeout_s)) if threading.current_thread() is threading.main_thread() else None

    def parse(text: str, **kw) -> list:
        return mv.parse(text, parsing_timeout=limit, raise_on_error=True, **kw)

    try:
        gold = parse("\\boxed{" + reference + "}", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])
        pred = parse(response) if gold else []
    except TimeoutException:  # a BaseException in math-verify: never caught by `except Exception`
        return False, True
    except Exception:
        return False, False
    timed_out = False
    for g in gold:  # math-verify's own order: any pair that compares equal
        for t in pred:
            try:
                if mv.verify(g, t, timeout_seconds=limit, raise_on_error=True):
                    return True, False
            except TimeoutException:
                timed_out = True
            except Exception:
                continue
    return False, timed_out


def math_verify_equal(response: str, reference: str, timeout_s: float = 5.0) -> bool:
    """math-verify's verdict alone (see :func:`math_verify_verdict`)."""
    return math_verify_verdict(response, reference, timeout_s)[0]
