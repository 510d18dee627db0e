"""What this process can run on: one answer for the model builder and the configuration rules.

A module of its own (no package imports) so that ``config/`` can ask it without importing ``models/``.
"""

from __future__ import annotations

import torch


def transformer_engine_available() -> bool:
    """Transformer Engine's layers are usable here: CUDA and an importable ``transformer_engine``
    (never on CPU; megatron-core's local layer spec runs there)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True
