"""An agent resolved once per run: what it is built from, its HF config read a single time.

Building an agent needs its architecture in several places: the trainer builds its Megatron model
from it (``LocalAgent`` in this process, or on every Ray rank), the rollout engines are started and
checked against it, the HF export writes its config, and ``model.dtype: auto`` follows the starting
checkpoint's dtype (``models/dtype.py``). :func:`resolve_agent` reads the starting checkpoint's
``config.json`` once (:func:`~hacrl_megatron.models.hf_io.read_hf_config`) into a frozen
:class:`ResolvedAgent`. ``trainer/runtime.build_runtime`` hands that record to the in-process model
load, to the trainer builder (and through ``agents/ray_worker.WorkerSetup`` to every Ray rank) and
to the engine builder; none of them reads the config again. The warm-up key and the planner apply
the same dtype rule without weights (``trainer/pretrain.warmup_key``, ``plan/experiment.agent_spec``).

:func:`agent_inputs` is the same resolution for a ``LocalAgent`` built from parts (tests, tools): an
agent config, optional HF weights and an optional HF config, or a resolved record.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hacrl_megatron.config import AgentConfig, ParallelConfig
from hacrl_megatron.config.schema import AUTO_DTYPE
from hacrl_megatron.models.convert import CheckpointMismatchError, SafetensorsSource
from hacrl_megatron.models.dtype import checkpoint_dtype, dtype_reason, resolve_model_dtype
from hacrl_megatron.models.hf_io import SMOLLM2, open_hf_model, read_hf_config
from hacrl_megatron.models.provider import (
    ArchSpec,
    arch_from_hf,
    arch_from_model_config,
    hf_config_from_model_config,
)
from hacrl_megatron.models.smollm2 import SMOLLM2_DTYPE, smollm2_hf_dir


@dataclass(frozen=True)
class ResolvedAgent:
    """One agent of a run as it is built; every builder takes this record instead of re-reading inputs.

    index: the agent's position in ``agents`` (the seed of its random init).
    cfg: its configuration with ``model.dtype`` resolved (never ``auto``): what its trainer, its Ray
        ranks and its engines are given.
    spec: its architecture, ``dtype`` included; None for ``backend: hf``, which trains any
        transformers causal LM and needs no Megatron description.
    hf_config: its transformers config: the starting checkpoint's, or built from the sizes in
        ``cfg.model``. The one object a run reads; the HF export later sets the tokenizer's special
        token ids on it.
    weights: the HF folder of the starting weights (``init_checkpoint``, else ``model.hf_path``, with
        ``"smollm2"`` the converted bundled model), or None for a seeded random init of the sizes.
    dtype: the parameter dtype its trainer holds (``cfg.model.dtype``; models/dtype.py says why).
    checkpoint_dtype: the dtype ``hf_config`` says the weights are stored in (None: built from sizes,
        or the config names none).
    engine: its rollout engine (``rollout.engine``: hf, sglang, vllm; None for an agent resolved
        without its run); :attr:`engine_gpu_ids` are that engine's GPUs.
    """

    index: int
    cfg: AgentConfig
    spec: ArchSpec | None
    hf_config: Any
    weights: Path | None
    dtype: str
    checkpoint_dtype: str | None
    engine: str | None = None

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def tokenizer_source(self) -> str:
        """``agents.N.tokenizer``: a built-in tokenizer's name or a tokenizer folder."""
        return self.cfg.tokenizer

    @property
    def parallel(self) -> ParallelConfig:
        """The trainer's layout (tp, pp, dp, ep, etp, cp and its options)."""
        return self.cfg.parallel

    @property
    def engine_gpu_ids(self) -> list[int]:
        """The GPUs of the agent's rollout engines (``rollout_gpu_ids``; empty: the engine's default)."""
        return list(self.cfg.rollout_gpu_ids)


def starting_weights_dir(cfg: AgentConfig) -> Path | None:
    """The HF folder agent ``cfg`` starts from (``init_checkpoint``, else ``model.hf_path``; "smollm2"
    is the bundled model), or None for a seeded random init. Raises when the folder is missing."""
    source = cfg.init_checkpoint or cfg.model.hf_path
    if source is None:
        return None
    if source == SMOLLM2:
        return Path(smollm2_hf_dir())
    if not Path(source).is_dir():
        raise FileNotFoundError(f"agent {cfg.name!r}: model directory {source!r} does not exist")
    if not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(f"agent {cfg.name!r}: model directory {source!r} has no config.json "
                                "(not an HF model folder)")
    return Path(source)


def configured_dtype(cfg: AgentConfig, *, engine: str | None = None, cuda: bool | None = None) -> tuple[str, str]:
    """(dtype, why): what ``cfg.model.dtype`` resolves to in this process before anything is built
    (``hacrl config``), by the rule :func:`resolve_agent` applies: ``auto`` against the ``config.json`` of
    the folder the agent starts from, when it has one (the bundled SmolLM2 is converted to float32,
    models/smollm2.py, and is not converted here)."""
    import torch

    cuda = torch.cuda.is_available() if cuda is None else cuda
    requested, source, stored = cfg.model.dtype, cfg.init_checkpoint or cfg.model.hf_path, None
    if requested == AUTO_DTYPE and source == SMOLLM2:
        stored = SMOLLM2_DTYPE
    elif requested == AUTO_DTYPE and source is not None and (Path(source) / "config.json").is_file():
        stored = checkpoint_dtype(read_hf_config(source))
    dtype = resolve_model_dtype(requested, stored, cuda=cuda, backend=cfg.backend, engine=engine)
    return dtype, dtype_reason(requested, stored, dtype, cuda=cuda, backend=cfg.backend, engine=engine)


def check_vocab(name: str, model_vocab: int, vocab_size: int) -> None:
    """A tokenizer of ``vocab_size`` ids fits the model's embedding of ``model_vocab`` rows."""
    if model_vocab < vocab_size:
        raise ValueError(f"agent {name!r}: model vocab {model_vocab} < tokenizer vocab {vocab_size}")


def resolve_agent(cfg: AgentConfig, vocab_size: int, *, index: int = 0, engine: str | None = None,
                  cuda: bool | None = None) -> ResolvedAgent:
    """Agent ``cfg`` (``index`` of its run, whose ``rollout.engine`` is ``engine``) resolved for a
    tokenizer of ``vocab_size`` ids: its starting folder's ``config.json`` read once (a random init
    reads nothing), its vocabulary checked against the tokenizer, ``model.dtype`` resolved (``engine``,
    ``cuda``: see :func:`~hacrl_megatron.models.dtype.resolve_model_dtype`) and its architecture
    described."""
    weights = starting_weights_dir(cfg)
    if weights is not None:
        hf_config = read_hf_config(weights)
        check_vocab(cfg.name, hf_config.vocab_size, vocab_size)
        stored = checkpoint_dtype(hf_config)
    else:
        hf_config, stored = hf_config_from_model_config(cfg.model, vocab_size=vocab_size), None
    dtype = resolve_model_dtype(cfg.model.dtype, stored, cuda=cuda, backend=cfg.backend, engine=engine)
    resolved_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
    spec = arch_from_hf(hf_config, dtype=dtype) if cfg.backend == "megatron" else None
    return ResolvedAgent(index=index, cfg=resolved_cfg, spec=spec, hf_config=hf_config, weights=weights, dtype=dtype,
                         checkpoint_dtype=stored, engine=engine)


def agent_inputs(agent_cfg: AgentConfig, vocab_size: int | None, hf_checkpoint: Any, hf_config: Any,
                 resolved: ResolvedAgent | None = None) -> tuple[ArchSpec, Any, Any]:
    """A ``LocalAgent``'s (ArchSpec, HF config, weight source or None).

    With ``resolved`` (an agent of a run): the record's spec and config, nothing read again; a folder
    ``hf_checkpoint`` is opened for its safetensors only, and ``hf_config`` (the loaded model's own)
    stands in for the record's config. Else, from the parts: an explicit ``hf_config``; else
    ``agent_cfg.model.hf_path``'s config; else the sizes in ``agent_cfg.model``; a folder
    ``hf_checkpoint`` must describe the same model. ``model.dtype: auto`` follows the config's dtype
    (models/dtype.py).
    """
    model_cfg = agent_cfg.model
    source = None
    if resolved is not None:
        spec, hf_config = resolved.spec, hf_config if hf_config is not None else resolved.hf_config
        if isinstance(hf_checkpoint, str):
            hf_checkpoint = SafetensorsSource(hf_checkpoint)
    else:
        if hf_config is None and model_cfg.hf_path is not None:
            hf_config, source = open_hf_model(model_cfg.hf_path, model_cfg.gguf_file)
        if hf_config is not None:
            dtype = resolve_model_dtype(model_cfg.dtype, checkpoint_dtype(hf_config), backend=agent_cfg.backend)
            spec = arch_from_hf(hf_config, dtype=dtype)
        else:
            hf_config = hf_config_from_model_config(model_cfg, vocab_size)
            spec = arch_from_model_config(model_cfg, vocab_size)
        if isinstance(hf_checkpoint, str):
            ck_config, hf_checkpoint = open_hf_model(hf_checkpoint)
            ck = arch_from_hf(ck_config, dtype=spec.dtype)
            if ck != spec:
                raise CheckpointMismatchError(f"HF checkpoint {ck} does not match the agent's model {spec}")
    if hf_checkpoint is not None:
        source = hf_checkpoint
    if vocab_size is not None and vocab_size > spec.vocab_size:
        raise ValueError(f"tokenizer vocab_size={vocab_size} exceeds the model's vocab_size={spec.vocab_size}")
    return spec, hf_config, source
