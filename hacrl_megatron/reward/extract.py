"""Final-answer extraction from a model response: the last ``\\boxed{...}`` (paper parity, docs/algorithm.md §9).

The MATH reward of the paper (and of its verl-based reference code) compares the content of the
**last** ``\\boxed{}`` in the response with the reference answer. This module finds that content:

- ``\\boxed{...}`` and ``\\fbox{...}`` with arbitrarily nested braces (scanned iteratively, so a
  deeply nested answer costs O(length), never recursion);
- ``\\boxed 5`` without braces: like the MATH graders, the argument runs to the next ``$`` (or the
  end of the line);
- an unbalanced last ``\\boxed{`` (a truncated response) gives ``None``: no answer, reward 0.
"""

from __future__ import annotations

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _last_box_start(text: str) -> tuple[int, str] | None:
    """Index and command name of the last ``\\boxed`` / ``\\fbox`` occurrence, or None."""
    best: tuple[int, str] | None = None
    for cmd in _BOX_COMMANDS:
        start = len(text)
        while True:
            idx = text.rfind(cmd, 0, start)
            if idx < 0:
                break
            after = text[idx + len(cmd) : idx + len(cmd) + 1]
            # "\boxedx" would be another macro name, not a box; "\boxed{", "\boxed 5" and a bare
            # "\boxed" at the very end (no argument) are boxes.
            if after == "" or after == "{" or after.isspace():
                if best is None or idx > best[0]:
                    best = (idx, cmd)
                break
            start = idx
    return best


def _braced_argument(text: str, open_idx: int) -> str | None:
    """Content of the brace group opening at ``text[open_idx] == '{'``; None when unbalanced."""
    depth = 0
    i = open_idx
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\" and i + 1 < n and text[i + 1] in "{}":
            i += 2  # an escaped brace \{ or \} is literal text (a set), not grouping
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_idx + 1 : i]
        i += 1
    return None


def braced_argument(text: str, open_idx: int) -> str | None:
    """Public alias of the brace-group scanner (used by the normaliser for ``\\text{}`` etc.)."""
    return _braced_argument(text, open_idx)


def last_boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{}``/``\\fbox{}`` in ``text``, or None when there is none.

    Examples: ``"so \\boxed{\\frac{1}{2}}."`` → ``"\\frac{1}{2}"``; ``"\\boxed 5$"`` → ``"5"``;
    ``"\\boxed{1} then \\boxed{2}"`` → ``"2"``; ``"\\boxed{1"`` (truncated) → None.
    """
    if not isinstance(text, str):
        raise TypeError(f"response must be str, got {type(text).__name__}")
    found = _last_box_start(text)
    if found is None:
        return None
    idx, cmd = found
    arg_start = idx + len(cmd)
    j = arg_start
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] == "{":
        return _braced_argument(text, j)
    if j == arg_start:
        return None  # "\boxed" at the very end or followed by a newline: no argument
    end = len(text)
    for stop in ("$", "\n"):
        k = text.find(stop, j)
        if 0 <= k < end:
            end = k
    arg = text[j:end].strip()
    return arg or None
