"""MATH-style answer normalisation and equivalence (the Hendrycks ``is_equiv`` family, own code).

The paper's reward (docs/algorithm.md §9) is "exact match of the last \\boxed{} answer after MATH-style string
normalisation". :func:`normalize_answer` applies the usual rewrites, in this order:

1. line breaks, ``\\!`` and spacing macros (``\\,`` ``\\;`` ``\\:`` ``~``), ``\\\\`` → ``\\``,
   ``tfrac``/``dfrac`` → ``frac``, ``\\left``/``\\right``, ``\\displaystyle``;
2. degrees (``^\\circ``, ``^{\\circ}``, ``°``), dollars (``\\$``), percent (``\\%``, ``%``);
3. a trailing unit: ``\\text{ cm}`` / ``\\mbox{ units}`` at the end, or a known unit word after a
   number (``5 cm``, ``12 dollars``);
4. ``\\text{}``, ``\\textbf{}``, ``\\mathrm{}``, ``\\mbox{}`` … unwrapped to their content;
5. ``x = 3`` → ``3`` (a one- or two-character left-hand side), a trailing period;
6. ``.5`` → ``0.5``; ``sqrt2``/``\\sqrt2``/``\\sqrt(2)`` → ``\\sqrt{2}``; ``\\frac12`` → ``\\frac{1}{2}``;
7. all spaces removed; thousands separators (``1,000`` → ``1000``, only in that exact pattern,
   so ``1,2`` stays a pair); ``a/b`` of two integers → ``\\frac{a}{b}``; a choice ``(A)`` → ``A``.

:func:`is_equiv` then compares the normalised strings, and — beyond the original string match —
treats two plain rational numbers as equal when their exact values agree (``2.0`` = ``2``,
``0.5`` = ``\\frac{1}{2}``, ``007`` = ``7``); this never evaluates powers or anything unbounded.
Deviation from Hendrycks, on purpose: ``\\text{ ...}`` is only dropped as a unit when it ends the
answer (Hendrycks drops everything after the first ``\\text{ ``, so ``1\\text{ and }2`` matched ``1``).
"""

from __future__ import annotations

import re
from fractions import Fraction

from hacrl_megatron.reward.extract import braced_argument

MAX_ANSWER_CHARS = 2000  # longer extracted answers are not normalised (score 0): no real answer is
_MAX_NUMBER_CHARS = 64  # exact-rational comparison only for short numerals (bounded cost)

_UNWRAP_MACROS = ("\\text", "\\textbf", "\\textit", "\\textrm", "\\mathrm", "\\mathbf", "\\mbox", "\\textup")
_UNIT_WORDS = (
    "units?|cm|mm|km|meters?|metres?|inch(?:es)?|feet|foot|ft|yards?|miles?|kg|grams?|pounds?|lbs?|"
    "ounces?|oz|dollars?|cents?|degrees?|hours?|hrs?|minutes?|mins?|seconds?|secs?|days?|weeks?|"
    "months?|years?|mph|square|sq|people|students|ways|points?|liters?|litres?|ml|gallons?|percent"
)
_TRAILING_UNIT_RE = re.compile(r"^(.*?\d)\s+(?:(?:" + _UNIT_WORDS + r")(?:\^\{?\d\}?)?\s*)+$")
_TRAILING_TEXT_UNIT_RE = re.compile(r"^(.+?)\s*\\(?:text|mbox|mathrm)\{\s+[A-Za-z][A-Za-z .^{}0-9]*\}$")
_THOUSANDS_RE = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_INT_SLASH_RE = re.compile(r"^([-+]?\d+)/(\d+)$")
_CHOICE_RE = re.compile(r"^\(?([A-E])\)?$")
_DECIMAL_RE = re.compile(r"^([-+]?)(\d*)(?:\.(\d*))?$")
_FRAC_RE = re.compile(r"^([-+]?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}$")
_BARE_SQRT_RE = re.compile(r"(?<![\\a-zA-Z])sqrt")


def _unwrap(s: str, macro: str) -> str:
    """Replace every ``macro{X}`` by ``X`` (brace-aware, innermost last, iterative)."""
    out = []
    i = 0
    n = len(s)
    while i < n:
        if s.startswith(macro + "{", i):
            arg = braced_argument(s, i + len(macro))
            if arg is not None:
                out.append(arg)
                i += len(macro) + len(arg) + 2
                continue
        out.append(s[i])
        i += 1
    return "".join(out)


def _scan_arg(s: str, i: int) -> tuple[str, int] | None:
    """One macro argument starting at ``s[i]``: a brace group, a paren group or one character.

    Returns (argument without delimiters, index after it), or None at the end of the string.
    """
    if i >= len(s):
        return None
    if s[i] == "{":
        arg = braced_argument(s, i)
        if arg is None:
            return None
        return arg, i + len(arg) + 2
    if s[i] == "\\":  # a macro argument: \frac\pi2 → {\pi}{2}
        j = i + 1
        while j < len(s) and s[j].isalpha():
            j += 1
        return s[i : max(j, i + 2)], max(j, i + 2)
    if s[i] == "(":
        depth = 0
        for j in range(i, len(s)):
            depth += {"(": 1, ")": -1}.get(s[j], 0)
            if depth == 0:
                return s[i + 1 : j], j + 1
        return None
    return s[i], i + 1


def _fix_macro_args(s: str, macro: str, nargs: int) -> str:
    """Brace the arguments of ``macro``: ``\\frac12`` → ``\\frac{1}{2}``, ``\\sqrt2`` → ``\\sqrt{2}``."""
    out = []
    i = 0
    while True:
        k = s.find(macro, i)
        if k < 0:
            out.append(s[i:])
            break
        j = k + len(macro)
        if j < len(s) and s[j].isalpha():  # a longer macro name (\fraction), leave it
            out.append(s[i:j])
            i = j
            continue
        out.append(s[i:j])
        if macro == "\\sqrt" and j < len(s) and s[j] == "[":  # \sqrt[3]{x}: keep the index
            close = s.find("]", j)
            if close > 0:
                out.append(s[j : close + 1])
                j = close + 1
        for _ in range(nargs):
            while j < len(s) and s[j] == " ":
                j += 1
            scanned = _scan_arg(s, j)
            if scanned is None:
                break
            arg, j = scanned
            out.append("{" + arg + "}")
        i = j
    return "".join(out)


def _strip_equation_lhs(s: str) -> str:
    """``x = 3`` → ``3`` when the left side is a short variable name (Hendrycks: ≤ 2 chars)."""
    parts = s.split("=")
    if len(parts) == 2 and len(parts[0].strip()) <= 2 and parts[0].strip() and parts[1].strip():
        return parts[1]
    return s


def normalize_answer(answer: str) -> str:
    """Normalised form of a final answer string (see the module docstring for the rules).

    Raises ValueError when ``answer`` is longer than ``MAX_ANSWER_CHARS`` (pathological input).
    """
    if len(answer) > MAX_ANSWER_CHARS:
        raise ValueError(
            f"answer has {len(answer)} characters, more than MAX_ANSWER_CHARS={MAX_ANSWER_CHARS}"
        )
    s = answer.strip().replace("\n", " ").replace("\\!", "")
    for spacing in ("\\,", "\\;", "\\:", "\\quad", "\\qquad", "~"):
        s = s.replace(spacing, " ")
    s = s.replace("\\\\", "\\").replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("°", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").strip()
    m = _TRAILING_TEXT_UNIT_RE.match(s)
    if m:
        s = m.group(1)
    for macro in _UNWRAP_MACROS:
        s = _unwrap(s, macro)
    m = _TRAILING_UNIT_RE.match(s.strip())
    if m:
        s = m.group(1)
    s = _strip_equation_lhs(s).strip().rstrip(".").strip()
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    s = _BARE_SQRT_RE.sub(r"\\sqrt", s)
    s = _fix_macro_args(s, "\\sqrt", 1)
    s = s.replace(" ", "")
    s = _fix_macro_args(s, "\\frac", 2)
    s = s.replace("{,}", ",")
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    m = _INT_SLASH_RE.match(s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    m = _CHOICE_RE.match(s)
    if m:
        s = m.group(1)
    return s


def rational_value(normalized: str) -> Fraction | None:
    """Exact value of a normalised plain number (``-2``, ``0.50``, ``\\frac{1}{2}``), else None.

    Only short numerals are parsed, so the cost is bounded for any input.
    """
    if not normalized or len(normalized) > _MAX_NUMBER_CHARS:
        return None
    m = _DECIMAL_RE.match(normalized)
    if m and (m.group(2) or m.group(3)):
        sign, whole, frac = m.group(1), m.group(2) or "0", m.group(3) or ""
        value = Fraction(int(whole + frac), 10 ** len(frac)) if frac else Fraction(int(whole))
        return -value if sign == "-" else value
    m = _FRAC_RE.match(normalized)
    if m and int(m.group(3)) != 0:
        value = Fraction(int(m.group(2)), int(m.group(3)))
        return -value if m.group(1) == "-" else value
    return None


def is_equiv(prediction: str | None, reference: str) -> bool:
    """True when a predicted final answer matches the reference after normalisation.

    ``prediction`` None (no answer found) is never equal. Equal normalised strings match; two plain
    rational numbers match when their exact values agree. Pathologically long answers never match.
    """
    if prediction is None:
        return False
    try:
        a = normalize_answer(prediction)
        b = normalize_answer(reference)
    except ValueError:
        return False
    if a == b:
        return True
    va, vb = rational_value(a), rational_value(b)
    return va is not None and vb is not None and va == vb
