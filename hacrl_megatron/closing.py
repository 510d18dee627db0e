"""Closing several resources after a run so that the error that stopped it stays the one reported.

A leaf module (standard library only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


def close_all(closers: list[Callable[[], object]], primary: BaseException | None) -> None:
    """Call every closer; with a ``primary`` error in flight, a closer's error is logged, not raised.

    Without one, the first closer error is raised after all closers ran. This keeps the error that
    stopped the run the one the user sees (a full disk also fails the metrics file's close).
    """
    first: BaseException | None = None
    for close in closers:
        try:
            close()
        except Exception as err:  # every closer must run
            if primary is not None:
                logger.warning("while stopping after %s: %s also failed: %s", type(primary).__name__,
                               getattr(close, "__qualname__", close), err)
            elif first is None:
                first = err
    if first is not None:
        raise first
