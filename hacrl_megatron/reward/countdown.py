"""Countdown checker: reach a target with some of the given numbers and + − × ÷ (no eval).

Reference format (the ``answer`` field of a countdown :class:`PromptRecord`)::

    "<target>|<n1>,<n2>,...,<nk>"      e.g. "24|2,3,5,7"

The response's last ``\\boxed{}`` must hold an arithmetic expression such as ``(7-3)*(5+1)``.
LaTeX operators (``\\times``, ``\\cdot``, ``\\div``, ``×``, ``÷``, ``\\frac{a}{b}``) are accepted, as is a
trailing ``= <target>``. The expression is parsed with :mod:`ast` and evaluated exactly with
:class:`fractions.Fraction`; only binary ``+ - * /`` on non-negative integer literals is allowed (no
unary minus, powers or names), division by zero scores 0, and the literals used must form a
sub-multiset of the given numbers (each given number at most once). Input length is capped, so
the parse depth and the cost are bounded for any response.
"""

from __future__ import annotations

import ast
import re
import threading
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

from hacrl_megatron.reward.extract import braced_argument, last_boxed_answer

_PARSE_LOCK = threading.Lock()

MAX_EXPRESSION_CHARS = 200  # a countdown expression over ≤ 10 numbers is far shorter
MAX_LITERAL_DIGITS = 12
_REFERENCE_RE = re.compile(r"^\s*(-?\d+)\s*\|\s*(\d+(?:\s*,\s*\d+)*)\s*$")
_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def encode_countdown_reference(target: int, numbers: Sequence[int]) -> str:
    """The reference string ``"target|n1,n2,..."`` for a countdown item."""
    if not numbers:
        raise ValueError("countdown numbers must be non-empty")
    if any((not isinstance(n, int)) or n < 0 for n in numbers):
        raise ValueError(f"countdown numbers must be non-negative ints, got {list(numbers)}")
    return f"{int(target)}|{','.join(str(n) for n in numbers)}"


def parse_countdown_reference(reference: str) -> tuple[int, list[int]]:
    """Inverse of :func:`encode_countdown_reference`; ValueError naming the format when malformed."""
    m = _REFERENCE_RE.match(reference)
    if m is None:
        raise ValueError(f"countdown reference {reference!r} does not match the format 'target|n1,n2,...'")
    return int(m.group(1)), [int(x) for x in m.group(2).split(",")]


def _latex_to_python(expr: str) -> str:
    """Rewrite LaTeX arithmetic into Python operator syntax."""
    for src, dst in (("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"), ("×", "*"), ("÷", "/"), ("·", "*")):
        expr = expr.replace(src, dst)
    expr = expr.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    expr = expr.replace("dfrac", "frac").replace("tfrac", "frac")
    while "\\frac{" in expr:  # \frac{a}{b} → ((a)/(b)), innermost handled by repetition
        k = expr.find("\\frac{")
        num = braced_argument(expr, k + 5)
        if num is None:
            break
        j = k + 5 + len(num) + 2
        den = braced_argument(expr, j) if j < len(expr) and expr[j] == "{" else None
        if den is None:
            break
        expr = f"{expr[:k]}(({num})/({den})){expr[j + len(den) + 2 :]}"
    return expr.replace("{", "(").replace("}", ")").replace("[", "(").replace("]", ")")


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an allowed expression tree; collects integer literals into ``used``."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        if node.value < 0 or len(str(node.value)) > MAX_LITERAL_DIGITS:
            raise ValueError(f"literal {node.value} is out of range")
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left = _evaluate(node.left, used)
        right = _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise ZeroDivisionError("division by zero in countdown expression")
        return left / right
    raise ValueError(f"disallowed syntax in countdown expression: {type(node).__name__}")


def _strip_target_equation(expr: str, target: int) -> str | None:
    """``(7-3)*6=24`` → ``(7-3)*6`` when the other side is the target; None if malformed."""
    if "=" not in expr:
        return expr
    sides = [p.strip() for p in expr.split("=")]
    if len(sides) != 2:
        return None
    if sides[1] == str(target):
        return sides[0]
    if sides[0] == str(target):
        return sides[1]
    return None


def countdown_expression_value(expr: str, numbers: Sequence[int]) -> Fraction | None:
    """Exact value of ``expr`` if it is a valid countdown expression over ``numbers``, else None."""
    if len(expr) > MAX_EXPRESSION_CHARS:
        return None
    py = _latex_to_python(expr).strip()
    try:
        with _PARSE_LOCK:  # CPython 3.11's ast.parse is not thread-safe (an in-process verifier may be threaded)
            tree = ast.parse(py, mode="eval")
        used: list[int] = []
        value = _evaluate(tree, used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None
    if not used or Counter(used) - Counter(numbers):
        return None  # no number used, or a number used more often than given
    return value


def check_countdown(response: str, reference: str) -> float:
    """1.0 when the last ``\\boxed{}`` expression reaches the target with allowed numbers, else 0.0."""
    target, numbers = parse_countdown_reference(reference)
    boxed = last_boxed_answer(response)
    if boxed is None:
        return 0.0
    expr = _strip_target_equation(boxed.strip().rstrip("."), target)
    if expr is None or not expr:
        return 0.0
    value = countdown_expression_value(expr, numbers)
    return 1.0 if value is not None and value == target else 0.0
