"""Where this package's log messages go when a command runs: the current stderr, at INFO.

A module of its own (not ``cli``) so that any command's entry point can call it without importing the
CLI, which imports every stage.
"""

from __future__ import annotations

import logging
import sys


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the message (tests and tools swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def log_to_console() -> None:
    """Show this package's INFO messages (warm-up progress, resume) on stderr; other libraries keep theirs."""
    log = logging.getLogger("hacrl_megatron")
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    # Set every time: whatever ran earlier in this process may have reset our level (pytest's caplog restores
    # NOTSET) or disabled our loggers (logging.config.dictConfig does by default); a resume note would vanish.
    for name, logger in logging.root.manager.loggerDict.items():
        if name.startswith("hacrl_megatron") and isinstance(logger, logging.Logger):
            logger.disabled = False
