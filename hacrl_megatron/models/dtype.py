"""``agents.N.model.dtype``: the parameter dtype of an agent's trainer, and what ``auto`` resolves to.

``auto`` (the default) follows the starting checkpoint: the dtype its HF config names
(``torch_dtype``, transformers 5's ``dtype``), so a bf16 checkpoint trains in bf16 unless a value is
set. Three cases keep float32:

* a model built from the sizes in ``agents.N.model`` (a random init, and every SFT warm-up): there is
  no checkpoint to follow;
* no CUDA in the process that resolves the agent (the controller): the CPU path computes in float32
  (the in-process HF engine and the HF backend hold float32 models, SGLang and vLLM on CPU are told
  the trainer's dtype, and the post-sync check compares float32 log-probs at 1e-3 per token);
* ``backend: hf``: the HF backend trains the float32 model it loads (``trainer/runtime.py``).

An explicit ``float32`` / ``bfloat16`` / ``float16`` always wins. The record an agent is resolved
into once per run (:class:`~hacrl_megatron.models.resolved.ResolvedAgent`) carries the result; the
planner applies the same rule for the GPUs it plans (``cuda=True``).
"""

from __future__ import annotations

from typing import Any

from hacrl_megatron.config.schema import AUTO_DTYPE, DTYPES

FLOAT32 = "float32"


def checkpoint_dtype(hf_config: Any) -> str | None:
    """The dtype an HF config says its weights are stored in, as one of ``DTYPES`` (``"bfloat16"``),
    or None when it names none of them. Reads ``dtype`` (transformers 5) and ``torch_dtype`` (older
    configs), as a ``torch.dtype`` or its name."""
    for key in ("dtype", "torch_dtype"):
        value = hf_config.get(key) if isinstance(hf_config, dict) else getattr(hf_config, key, None)
        if value is not None:
            name = str(value).removeprefix("torch.")
            return name if name in DTYPES else None
    return None


def resolve_model_dtype(requested: str, checkpoint: str | None, *, cuda: bool | None = None,
                        backend: str = "megatron") -> str:
    """The parameter dtype an agent trains in (one of ``DTYPES``), by the rules of this module.

    requested: ``agents.N.model.dtype`` (``"auto"`` or a dtype name, which is returned as it is).
    checkpoint: the starting checkpoint's dtype (:func:`checkpoint_dtype`), None for a model built
        from sizes.
    cuda: whether the agent computes on CUDA; default ``torch.cuda.is_available()`` in this process.
    backend: ``agents.N.backend``; the HF backend trains float32.
    """
    if requested != AUTO_DTYPE:
        return requested
    if checkpoint is None or backend == "hf":
        return FLOAT32
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return checkpoint if cuda else FLOAT32


def dtype_reason(requested: str, checkpoint: str | None, resolved: str, *, cuda: bool, backend: str) -> str:
    """Why ``requested`` became ``resolved`` (for ``hacrl config``): ``"set"`` or the rule ``auto`` took."""
    if requested != AUTO_DTYPE:
        return "set in the config"
    if checkpoint is None:
        return "auto: no checkpoint to follow (a model built from its sizes, or no dtype in its config)"
    if backend == "hf":
        return "auto: the hf backend trains float32"
    if not cuda:
        return f"auto: no CUDA here, the CPU path computes in float32 (the checkpoint's is {checkpoint})"
    return f"auto: the starting checkpoint's dtype ({checkpoint})"
