"""``agents.N.model.dtype``: the parameter dtype of an agent's trainer, and what ``auto`` resolves to.

``auto`` (the default) follows the starting checkpoint: the dtype its HF config names
(``torch_dtype``, transformers 5's ``dtype``), so a bf16 checkpoint trains in bf16 unless a value is
set. Four cases keep float32, each because something the trainer is checked against is float32:

* a model built from the sizes in ``agents.N.model`` (a random init, and every SFT warm-up): there is
  no checkpoint to follow;
* no CUDA in the process that resolves the agent (the controller): the CPU path is float32 (bf16
  matmuls are slow on CPUs without bf16 units; the CPU demos, their tolerances and the recorded
  goldens are float32; SGLang and vLLM on CPU are told the trainer's dtype);
* ``backend: hf``: the HF backend trains the float32 model it loads (``trainer/runtime.py``);
* ``rollout.engine: hf``: the in-process engine samples from that float32 model, and the post-sync
  check holds trainer and engine to 1e-3 nats per token (``sync/check.py``), which a bf16 trainer
  against a float32 engine does not meet.

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
    configs), as a ``torch.dtype`` or its name; ``hf_config`` is a transformers config or its dict."""
    for key in ("dtype", "torch_dtype"):
        value = hf_config.get(key) if isinstance(hf_config, dict) else getattr(hf_config, key, None)
        if value is not None:
            name = str(value).removeprefix("torch.")
            return name if name in DTYPES else None
    return None


def resolve_model_dtype(requested: str, checkpoint: str | None, *, cuda: bool | None = None,
                        backend: str = "megatron", engine: str | None = None) -> str:
    """The parameter dtype an agent trains in (one of ``DTYPES``), by the rules of this module.

    requested: ``agents.N.model.dtype`` (``"auto"`` or a dtype name, which is returned as it is).
    checkpoint: the starting checkpoint's dtype (:func:`checkpoint_dtype`), None for a model built
        from sizes.
    cuda: whether the agent computes on CUDA; default ``torch.cuda.is_available()`` in this process.
    backend: ``agents.N.backend``; the HF backend trains float32.
    engine: ``rollout.engine`` (None: not known, e.g. an agent built alone); the in-process ``hf``
        engine samples in float32.
    """
    if requested != AUTO_DTYPE:
        return requested
    if checkpoint is None or backend == "hf" or engine == "hf":
        return FLOAT32
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return checkpoint if cuda else FLOAT32


def dtype_reason(requested: str, checkpoint: str | None, resolved: str, *, cuda: bool, backend: str,
                 engine: str | None = None) -> str:
    """Why ``requested`` became ``resolved``, in a few words (``hacrl config``): set, or the rule auto took."""
    if requested != AUTO_DTYPE:
        return "set in the config"
    if checkpoint is None:
        return "auto: no checkpoint dtype to follow, the model is built from its sizes or its config names none"
    if backend == "hf":
        return "auto: the hf backend trains float32"
    if engine == "hf":
        return f"auto: the in-process hf engine samples in float32; the checkpoint stores {checkpoint}"
    if not cuda:
        return f"auto: float32 without CUDA, the CPU path; the checkpoint stores {checkpoint}"
    return f"auto: the starting checkpoint stores {resolved}"
