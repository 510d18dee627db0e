"""The one exception base for unusable user input, and the SIGTERM exception (a leaf module: every stage
may import it).

A config value, a preset or data file, a checkpoint folder or a tokenizer that cannot be used
raises a subclass of :class:`InputError` whose message names the field or file, the value and the
rule; ``hacrl`` prints that one line and exits with status 2 instead of a traceback.
"""

from __future__ import annotations


class InputError(ValueError):
    """User input that cannot be used; the message names the field or file, the value and the rule."""


class Terminated(BaseException):
    """SIGTERM (a scheduler stopping the job: Slurm's scancel or time limit), raised in the main thread
    like Ctrl-C's KeyboardInterrupt so that the run stops the same way (exit 143 = 128 + SIGTERM)."""
