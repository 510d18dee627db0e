"""The one exception base for unusable user input, and the SIGTERM exception (a leaf module: every stage
may import it).

A config value, a preset or data file, a checkpoint folder or a tokenizer that cannot be used
raises a subclass of :class:`InputError` whose message names the field or file, the value and the
rule; ``hacrl`` prints that one line and exits with status 2 instead of a traceback.
"""

from __future__ import annotations

import re


class InputError(ValueError):
    """User input that cannot be used; the message names the field or file, the value and the rule."""


class Terminated(BaseException):
    """SIGTERM (a scheduler stopping the job: Slurm's scancel or time limit), raised in the main thread
    like Ctrl-C's KeyboardInterrupt so that the run stops the same way (exit 143 = 128 + SIGTERM)."""


_QUOTED = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"")


def _path_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each path in ``text``: a quoted span holding a ``/`` (how Python's own errors quote
    file names, spaces included), else a space-free word holding a ``/``."""
    spans = [m.span() for m in _QUOTED.finditer(text) if "/" in m.group()]
    for m in re.finditer(r"\S*/\S*", text):
        if not any(a <= m.start() < b or a < m.end() <= b for a, b in spans):
            spans.append(m.span())
    return sorted(spans)


def one_line_text(text: str, limit: int = 300) -> str:
    """``text`` on one line (whitespace runs become one space), cut with ``...`` once about ``limit``
    characters of it that are not paths have been shown. A path is never cut and does not count
    against ``limit``: a user is always shown it whole, and a long path leaves the words around it
    (the reason) in the message."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    shown, pos = 0, 0
    for start, end in [*_path_spans(text), (len(text), len(text))]:
        if shown + (start - pos) > limit:
            cut = pos + (limit - shown)
            return text[:cut] + "..."
        shown += start - pos
        pos = end
    return text
