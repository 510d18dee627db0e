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


def one_line_text(text: str, limit: int = 300) -> str:
    """``text`` on one line (whitespace runs become one space), cut after about ``limit`` characters
    with ``...``, but never inside a path: a cut that would fall in a quoted span holding a ``/`` (how
    Python's own errors quote file names, spaces included) or in a word holding a ``/`` moves to that
    span's end, so the user is always shown a path whole."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = limit
    for span in _QUOTED.finditer(text):
        if span.start() < cut < span.end() and "/" in span.group():
            cut = span.end()
            break
    else:
        word_start = text.rfind(" ", 0, cut) + 1
        word_end = text.find(" ", cut)
        word_end = len(text) if word_end < 0 else word_end
        if "/" in text[word_start:word_end]:
            cut = word_end
    return text if cut >= len(text) else text[:cut] + "..."
