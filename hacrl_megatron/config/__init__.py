"""Experiment configuration: small dataclasses, YAML presets, dotted command-line overrides.

Every field has a docstring-style comment; ``validate()`` runs before any work starts and raises
:class:`ConfigError` naming the field, the offending value and the rule it breaks.

Usage::

    cfg = load_config("cpu_demo", ["hacpo.alpha=3", "agents.0.parallel.tp=2"])

A preset is a built-in name (``hacrl_megatron/presets/<name>.yaml``) or a path to a YAML file.
"""

from hacrl_megatron.config.loading import (
    apply_override,
    deep_merge,
    from_dict,
    load_config,
    preset_names,
    read_preset,
)
from hacrl_megatron.config.schema import (
    ALGORITHMS,
    ARCHS,
    BACKENDS,
    CROSS_CLIP_MODES,
    CROSS_WINDOWS,
    DTYPES,
    ENGINES,
    EOS_MODES,
    KL_ESTIMATORS,
    MINIBATCH_ORDERS,
    PRESET_DIR,
    RECOMPUTE,
    ROLLOUT_MODES,
    SGLANG_PYTHON_ENV,
    VLLM_DTYPES,
    VLLM_PYTHON_ENV,
    WEIGHT_SYNC_MODES,
    WORKERS,
    AgentConfig,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    ExperimentConfig,
    HACPOConfig,
    HFEngineConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    SGLangConfig,
    TrainConfig,
    VLLMConfig,
)
from hacrl_megatron.config.validation import (
    check_data_files,
    validate,
    validate_agent,
    validate_data_names,
    validate_sglang_python,
    validate_vllm_python,
)

__all__ = [
    "ALGORITHMS",
    "ARCHS",
    "AgentConfig",
    "BACKENDS",
    "CROSS_CLIP_MODES",
    "CROSS_WINDOWS",
    "KL_ESTIMATORS",
    "MINIBATCH_ORDERS",
    "ROLLOUT_MODES",
    "CheckpointConfig",
    "ConfigError",
    "DTYPES",
    "DataConfig",
    "ENGINES",
    "EOS_MODES",
    "ExperimentConfig",
    "HACPOConfig",
    "HFEngineConfig",
    "LogConfig",
    "ModelConfig",
    "PRESET_DIR",
    "ParallelConfig",
    "RECOMPUTE",
    "RolloutConfig",
    "SGLANG_PYTHON_ENV",
    "SGLangConfig",
    "TrainConfig",
    "VLLMConfig",
    "VLLM_DTYPES",
    "VLLM_PYTHON_ENV",
    "WEIGHT_SYNC_MODES",
    "WORKERS",
    "apply_override",
    "check_data_files",
    "deep_merge",
    "from_dict",
    "load_config",
    "preset_names",
    "read_preset",
    "validate",
    "validate_agent",
    "validate_data_names",
    "validate_sglang_python",
    "validate_vllm_python",
]
