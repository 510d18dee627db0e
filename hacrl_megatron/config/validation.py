"""The configuration's rules, checked before any work starts; each failure names field, value and rule."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from hacrl_megatron.config.bounded_yaml import short_repr
from hacrl_megatron.config.layout import LayoutError, expert_data_parallel, pipeline_layers
from hacrl_megatron.config.ranges import PER_NODE_HOST, range_error, validate_ranges
from hacrl_megatron.config.schema import (
    ALGORITHMS,
    ARCHS,
    BACKENDS,
    CROSS_CLIP_MODES,
    CROSS_WINDOWS,
    ENGINES,
    EOS_MODES,
    EXCHANGE_BACKENDS,
    KL_ESTIMATORS,
    MINIBATCH_ORDERS,
    MODEL_DTYPES,
    MOE_ARCHS,
    ON_MISSING,
    RECOMPUTE,
    ROLLOUT_MODES,
    SGLANG_PYTHON_ENV,
    SHARING_ALGORITHMS,
    TOKEN_LEVEL_ALGORITHMS,
    VLLM_DTYPES,
    VLLM_PYTHON_ENV,
    WEIGHT_SYNC_MODES,
    WORKERS,
    AgentConfig,
    ConfigError,
    DataConfig,
    ExperimentConfig,
    SGLangConfig,
    VLLMConfig,
)
from hacrl_megatron.config.validation_colocate import validate_colocation
from hacrl_megatron.config.validation_scale import (
    validate_context_parallel,
    validate_data_parallel_overlap,
    validate_row_geometry,
)
from hacrl_megatron.config.validation_warmup import validate_shared_warmups, validate_warmup_families

# --------------------------------------------------------------------------------------------
# validation


def _rule(ok: bool, path: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{path}={short_repr(value)}: {rule}")


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
    _one_of(f"{path}.model.dtype", m.dtype, MODEL_DTYPES)
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size"):
        _rule(getattr(m, name) >= 1, f"{path}.model.{name}", getattr(m, name), "must be >= 1")
    _rule(m.hidden_size % m.num_heads == 0, f"{path}.model.hidden_size", m.hidden_size,
          f"must be divisible by num_heads={m.num_heads}")
    _rule(m.num_heads % m.num_kv_heads == 0, f"{path}.model.num_kv_heads", m.num_kv_heads,
          f"must divide num_heads={m.num_heads}")
    for name in ("tp", "pp", "dp", "ep", "etp"):
        _rule(getattr(p, name) >= 1, f"{path}.parallel.{name}", getattr(p, name), "must be >= 1")
    if m.hf_path is None:  # for HF models the provider checks against the real config
        _rule(m.num_heads % p.tp == 0, f"{path}.parallel.tp", p.tp, f"must divide num_heads={m.num_heads}")
        _rule(m.num_kv_heads % p.tp == 0, f"{path}.parallel.tp", p.tp,
              f"must divide num_kv_heads={m.num_kv_heads}")
        try:
            pipeline_layers(m.num_layers, p.pp)
        except LayoutError as err:
            raise ConfigError(f"{path}.parallel.pp={p.pp!r}: {err}") from None
    validate_moe(agent_cfg, path)
    validate_data_parallel_overlap(agent_cfg, path)
    validate_context_parallel(agent_cfg, path)
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


def validate_moe(agent_cfg: AgentConfig, path: str) -> None:
    """The Mixture-of-Experts fields and the expert layout (ep, etp) of one agent."""
    m, p = agent_cfg.model, agent_cfg.parallel
    moe = m.arch in MOE_ARCHS
    try:
        expert_data_parallel(p.tp, p.dp, p.ep, p.etp, max(p.cp, 1))
    except LayoutError as err:
        raise ConfigError(f"{path}.parallel.ep={p.ep!r}: {err}") from None
    _rule(moe or (p.ep, p.etp) == (1, 1), f"{path}.parallel.ep", (p.ep, p.etp),
          f"expert parallelism (ep, etp) needs a Mixture-of-Experts arch {list(MOE_ARCHS)}, model.arch={m.arch!r}")
    _rule(not moe or p.ep > 1 or p.etp == p.tp, f"{path}.parallel.etp", p.etp,
          f"with ep=1 the experts must be split like attention: set etp = tp = {p.tp} (or ep > 1)")
    _rule(not moe or p.tp == 1 or p.sequence_parallel, f"{path}.parallel.sequence_parallel", p.sequence_parallel,
          f"MoE layers with tp={p.tp} > 1 need sequence parallelism (megatron-core routes each rank's slice of "
          "the sequence): set parallel.sequence_parallel: true")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        _rule(getattr(m, name) >= 0, f"{path}.model.{name}", getattr(m, name), "must be >= 0")
    _rule(moe or not m.moe_routing_replay, f"{path}.model.moe_routing_replay", True,
          f"routing replay needs a Mixture-of-Experts arch {list(MOE_ARCHS)}, model.arch={m.arch!r}")
    _rule(not m.moe_routing_replay or p.recompute != "full" or p.pp == 1, f"{path}.model.moe_routing_replay", True,
          "with parallel.recompute=full and pp > 1 the recomputed forwards of several micro-batches interleave and "
          "megatron's replay would hand them the wrong routes: use recompute none/selective or pp=1")
    _rule(agent_cfg.backend == "megatron" or not moe, f"{path}.backend", agent_cfg.backend,
          "Mixture-of-Experts agents train with backend: megatron")
    if m.hf_path is not None:  # sizes come from the HF config: the provider checks them against the layout
        return
    if not moe:
        _rule(m.num_experts == 0, f"{path}.model.num_experts", m.num_experts,
              f"must be 0 for the dense arch {m.arch!r} (MoE archs: {list(MOE_ARCHS)})")
        return
    _rule(m.num_experts >= 2, f"{path}.model.num_experts", m.num_experts, f"an MoE arch ({m.arch}) needs >= 2 experts")
    _rule(1 <= m.moe_topk <= m.num_experts, f"{path}.model.moe_topk", m.moe_topk,
          f"must lie in [1, num_experts={m.num_experts}]")
    _rule(m.num_experts % p.ep == 0, f"{path}.parallel.ep", p.ep, f"must divide model.num_experts={m.num_experts}")
    width = m.moe_ffn_hidden_size or m.ffn_hidden_size
    _rule(m.moe_ffn_hidden_size >= 0, f"{path}.model.moe_ffn_hidden_size", m.moe_ffn_hidden_size, "must be >= 0")
    _rule(width % p.etp == 0, f"{path}.parallel.etp", p.etp, f"must divide the expert FFN width {width}")
    shared = m.shared_expert_ffn_hidden_size
    _rule(shared == 0 or m.arch == "qwen2_moe", f"{path}.model.shared_expert_ffn_hidden_size", shared,
          f"a shared expert is part of qwen2_moe only, model.arch={m.arch!r}")
    _rule(shared % p.tp == 0 and shared >= 0, f"{path}.model.shared_expert_ffn_hidden_size", shared,
          f"must be >= 0 and divisible by tp={p.tp} (the shared expert is tensor-parallel like a dense MLP)")


def validate_sglang_python(s: SGLangConfig) -> None:
    """The SGLang interpreter (``rollout.sglang.python``, else ``$HACRL_SGLANG_PYTHON``) must be an
    executable file when one is named (checked before any server starts; unset: this Python)."""
    if s.command:  # a custom launcher replaces the whole command line, interpreter included
        _rule(not s.python, "rollout.sglang.python", s.python,
              "is unused when rollout.sglang.command is set: put the interpreter into that command")
        return
    path = s.python or os.environ.get(SGLANG_PYTHON_ENV)
    name = "rollout.sglang.python" if s.python else f"rollout.sglang.python (from ${SGLANG_PYTHON_ENV})"
    if path:
        _rule(os.path.isfile(path), name, path, "must be an existing file (the Python of SGLang's environment)")
        _rule(os.access(path, os.X_OK), name, path, "must be executable")


def validate_vllm_python(v: VLLMConfig) -> None:
    """The vLLM interpreter (``rollout.vllm.python``, else ``$HACRL_VLLM_PYTHON``) must be an executable
    file when one is named (checked before any server starts; unset: this Python)."""
    if v.command:  # a custom launcher replaces the whole command line, interpreter included
        _rule(not v.python, "rollout.vllm.python", v.python,
              "is unused when rollout.vllm.command is set: put the interpreter into that command")
        return
    path = v.python or os.environ.get(VLLM_PYTHON_ENV)
    name = "rollout.vllm.python" if v.python else f"rollout.vllm.python (from ${VLLM_PYTHON_ENV})"
    if path:
        _rule(os.path.isfile(path), name, path,
              "must be an existing file (the Python of vLLM's environment, e.g. .venv-vllm/bin/python)")
        _rule(os.access(path, os.X_OK), name, path, "must be executable")


def validate_vllm(cfg: ExperimentConfig) -> None:
    """``rollout.vllm.*``; the interpreter only when ``rollout.engine`` is vllm."""
    v = cfg.rollout.vllm
    _rule(v.tp >= 1, "rollout.vllm.tp", v.tp, "must be >= 1")
    _rule(0 < v.gpu_memory_utilization < 1, "rollout.vllm.gpu_memory_utilization", v.gpu_memory_utilization,
          "must lie in (0, 1)")
    _rule(v.cpu_kv_cache_gib >= 1, "rollout.vllm.cpu_kv_cache_gib", v.cpu_kv_cache_gib, "must be >= 1 (GiB)")
    _one_of("rollout.vllm.dtype", v.dtype, VLLM_DTYPES)
    _rule(v.max_model_len >= 0, "rollout.vllm.max_model_len", v.max_model_len,
          "must be >= 0 (0: the model's max_position_embeddings)")
    need = cfg.rollout.max_prompt_len + cfg.rollout.max_response_len
    _rule(v.max_model_len == 0 or v.max_model_len >= need, "rollout.vllm.max_model_len", v.max_model_len,
          f"must hold rollout.max_prompt_len + rollout.max_response_len = {need} tokens (or 0)")
    _rule(v.max_num_seqs >= 0, "rollout.vllm.max_num_seqs", v.max_num_seqs, "must be >= 0 (0: vLLM's default)")
    if cfg.rollout.engine != "vllm":
        return
    _rule(cfg.rollout.weight_sync != "tensor" or v.tp == 1, "rollout.vllm.tp", v.tp,
          "rollout.weight_sync=tensor (CUDA IPC) reaches the trainer's one GPU: each vLLM server needs tp=1 "
          "(or use disk / distributed)")
    validate_vllm_python(v)
    for i, agent_cfg in enumerate(cfg.agents):
        ids = agent_cfg.rollout_gpu_ids
        _rule(len(ids) % v.tp == 0, f"agents.{i}.rollout_gpu_ids", ids,
              f"needs one GPU per vLLM TP rank: a multiple of rollout.vllm.tp={v.tp} (one engine per group)")
    ranks, cores = len(cfg.agents) * v.tp, os.cpu_count() or 1
    # CPU servers (no rollout_gpu_ids): every TP rank of every agent's server is bound to a core of its own
    _rule(v.tp == 1 or any(a.rollout_gpu_ids for a in cfg.agents) or ranks <= cores, "rollout.vllm.tp", v.tp,
          f"on CPU gives each of the {ranks} server ranks ({len(cfg.agents)} agents x tp) a core of its own; this "
          f"machine has {cores}: lower rollout.vllm.tp (1 fits any machine)")


def validate_per_node_hosts(rollout: Any) -> None:
    """``rollout.<engine>.host`` with ``placement: ray``: the servers run on many nodes, so one fixed
    address (or 0.0.0.0, every interface) would be bound and advertised by all of them; only empty
    (each node's address) or a placeholder each node resolves for itself is accepted."""
    for name in ("sglang", "vllm"):
        section = getattr(rollout, name)
        host = getattr(section, "host", "")
        if getattr(section, "placement", "local") != "ray" or not host:
            continue
        _rule(PER_NODE_HOST.fullmatch(host) is not None, f"rollout.{name}.host", host,
              f"with rollout.{name}.placement=ray every node's server would bind and advertise this one address; "
              "leave it empty (each node's address as Ray knows it) or use a per-node placeholder: {node_ip}, or "
              "{iface:NAME} (that interface's IPv4 address on each node)")


def validate_rollout(cfg: ExperimentConfig) -> None:
    """``rollout.*``: the engine and its section (``rollout.hf``, ``rollout.sglang``), how weights
    reach it, sampling; and each agent's ``rollout_gpu_ids`` against the SGLang server size."""
    _one_of("rollout.sglang.placement", cfg.rollout.sglang.placement, ("local", "ray"))
    validate_per_node_hosts(cfg.rollout)
    r = cfg.rollout
    _one_of("rollout.engine", r.engine, ENGINES)
    _one_of("rollout.eos_mode", r.eos_mode, EOS_MODES)
    _one_of("rollout.weight_sync", r.weight_sync, WEIGHT_SYNC_MODES)
    modes = ["auto", *r.engine_settings.WEIGHT_SYNC]
    _rule(r.weight_sync in modes, "rollout.weight_sync", r.weight_sync,
          f"rollout.engine={r.engine} takes weights by {modes}")
    _rule(r.weight_sync_bucket_mb >= 1, "rollout.weight_sync_bucket_mb", r.weight_sync_bucket_mb, "must be >= 1")
    validate_colocation(cfg)  # config/validation_colocate.py
    _rule(r.hf.max_batch_size >= 1, "rollout.hf.max_batch_size", r.hf.max_batch_size, "must be >= 1")
    s = r.sglang
    _rule(s.tp >= 1, "rollout.sglang.tp", s.tp, "must be >= 1")
    if r.engine == "sglang":
        validate_sglang_python(s)
    _rule(0 < s.mem_fraction < 1, "rollout.sglang.mem_fraction", s.mem_fraction, "must lie in (0, 1)")
    validate_vllm(cfg)
    for i, agent_cfg in enumerate(cfg.agents):
        ids = agent_cfg.rollout_gpu_ids
        _rule(r.engine == "vllm" or len(ids) % s.tp == 0, f"agents.{i}.rollout_gpu_ids", ids,
              f"needs one GPU per SGLang TP rank: a multiple of rollout.sglang.tp={s.tp} (one engine per group)")
        _rule(len(set(ids)) == len(ids), f"agents.{i}.rollout_gpu_ids", ids, "lists a GPU twice")
    _rule(r.samples_per_prompt >= 2, "rollout.samples_per_prompt", r.samples_per_prompt,
          "G must be >= 2: group baselines need at least two samples")
    _rule(r.temperature > 0, "rollout.temperature", r.temperature, "must be > 0")
    _rule(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must lie in (0, 1]")
    _rule(r.max_prompt_len >= 1, "rollout.max_prompt_len", r.max_prompt_len, "must be >= 1")
    _rule(r.max_response_len >= 1, "rollout.max_response_len", r.max_response_len, "must be >= 1")


def validate_data_names(data: DataConfig) -> None:
    """``data.task`` names a procedural task or a dataset; ``data.path`` is only read by datasets.

    Pure (no file access): presets that name cluster paths still load anywhere. Whether the data
    files exist and parse is :func:`check_data_files`'s job (``hacrl config``, and training start-up).
    """
    from hacrl_megatron.data import BENCHMARKS, TASKS

    _rule(data.task in TASKS or data.task in BENCHMARKS, "data.task", data.task,
          f"must be a procedural task {list(TASKS)} or a dataset {list(BENCHMARKS)}")
    _rule(data.path is None or data.task in BENCHMARKS, "data.path", data.path,
          f"is only read by dataset tasks {list(BENCHMARKS)}; data.task={data.task!r} is procedural (a file of "
          "your own, in our layout or verl's: data.task=custom)")
    _rule(data.path is None or data.path.strip() != "", "data.path", data.path, "must not be empty (omit it)")
    validate_eval_benchmarks(data)
    for key in ("prompt_key", "answer_key"):
        value = getattr(data, key)
        _rule(value is None or data.task == "custom", f"data.{key}", value,
              f"names a column of a custom file: only read with data.task=custom (data.task={data.task!r})")
        _rule(value is None or 0 < len(value.strip()) <= 256, f"data.{key}", value, "must be a column name of 1 "
              "to 256 characters (a dotted one reaches into a mapping: reward_model.ground_truth)")
    low_high = data.reward_range
    _rule(len(low_high) == 2 and all(math.isfinite(x) for x in low_high) and low_high[0] < low_high[1],
          "data.reward_range", low_high, "must be [low, high], two finite numbers with low < high")
    if data.checker is not None:
        from hacrl_megatron.reward.custom import CheckerError, parse_checker_spec

        try:
            parse_checker_spec(data.checker)
        except CheckerError as err:
            raise ConfigError(str(err)) from None


def validate_eval_benchmarks(data: DataConfig) -> None:
    """``data.eval_benchmarks`` names known benchmarks, each once; ``data.benchmark_paths`` names datasets."""
    from hacrl_megatron.data import BENCHMARKS, TASKS

    for name in data.eval_benchmarks:
        _rule(name in BENCHMARKS or name in TASKS, "data.eval_benchmarks", data.eval_benchmarks,
              f"{name!r} is not a benchmark: datasets {list(BENCHMARKS)}, procedural tasks {list(TASKS)}")
        _rule(data.eval_benchmarks.count(name) == 1, "data.eval_benchmarks", data.eval_benchmarks,
              f"{name!r} is listed twice")
    for name, path in data.benchmark_paths.items():
        _rule(name in BENCHMARKS, f"data.benchmark_paths.{name}", path,
              f"{name!r} is not a dataset benchmark {list(BENCHMARKS)} (procedural tasks need no file)")
        _rule(path.strip() != "", f"data.benchmark_paths.{name}", path, "must name a file or folder")


def check_data_files(data: DataConfig) -> list[Path]:
    """The files ``data`` reads, checked to exist now (no parsing); [] for procedural tasks.
    ``data.checker``, when set, is imported and checked too (in a child process, bounded in time).

    Raises ConfigError naming ``data.path`` (or ``$HACRL_DATA_DIR``) and where files were expected.
    """
    from hacrl_megatron.data import BENCHMARKS
    from hacrl_megatron.reward.custom import CheckerError, check_checker

    if data.checker is not None:  # the user's checker imports (in bounded time) and has the right signature
        try:
            check_checker(data.checker)
        except CheckerError as err:
            raise ConfigError(str(err)) from None
    from hacrl_megatron.data.eval_sets import benchmark_problem

    for name in data.eval_benchmarks:  # each benchmark's file is here (found where training will read it)
        problem = benchmark_problem(name, data.benchmark_paths)
        key = f"data.benchmark_paths.{name}" if name in data.benchmark_paths else "data.eval_benchmarks"
        _rule(problem is None, key, data.benchmark_paths.get(name, data.eval_benchmarks), problem or "")
    if data.task not in BENCHMARKS:
        return []
    from hacrl_megatron.data.benchmarks import DataFileError
    from hacrl_megatron.data.splits import training_split

    try:
        return training_split(data.task, data.path, data.allow_test_split)[1]
    except FileNotFoundError as err:
        raise ConfigError(f"data.path={data.path!r}: {err}") from None
    except DataFileError as err:  # a test split not allowed: the message names data.path
        raise ConfigError(str(err)) from None


def validate_exchange(cfg: ExperimentConfig) -> None:
    """exchange.*: a known backend and on_missing policy, and the option the backend needs (docs/exchange.md)."""
    x = cfg.exchange
    _one_of("exchange.backend", x.backend, EXCHANGE_BACKENDS)
    _one_of("exchange.on_missing", x.on_missing, ON_MISSING)
    _rule(x.backend != "shared_dir" or bool(x.dir), "exchange.dir", x.dir, "required when exchange.backend=shared_dir")
    _rule(x.backend != "redis" or bool(x.redis_url), "exchange.redis_url", x.redis_url,
          "required when exchange.backend=redis")


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    """Check every rule; raise ConfigError naming field, value and rule. Returns ``cfg``.

    Every field's own range is checked too (:func:`~hacrl_megatron.config.ranges.validate_ranges`);
    when a cross-field rule fails and names another field than one out of its own range (a
    divisibility rule reporting ``hidden_size`` for a huge ``num_heads``), the field out of range
    is reported instead.
    """
    try:
        _check_rules(cfg)
    except ConfigError as err:
        out_of_range = range_error(cfg)
        if out_of_range is not None and out_of_range.field not in str(err):
            raise out_of_range from None
        raise
    validate_ranges(cfg)  # every field's real range, names and paths included (config/ranges.py)
    return cfg


def _check_rules(cfg: ExperimentConfig) -> None:
    """The rules between fields and the enumerations (:func:`validate` adds every field's range)."""
    _rule(len(cfg.agents) >= 1, "agents", len(cfg.agents), "at least one agent is required")
    seen: set[str] = set()
    for i, agent_cfg in enumerate(cfg.agents):
        _rule(agent_cfg.name not in seen, f"agents.{i}.name", agent_cfg.name, "duplicate agent name")
        seen.add(agent_cfg.name)
        validate_agent(agent_cfg, f"agents.{i}")
    validate_shared_warmups(cfg.agents)
    validate_warmup_families(cfg)
    h, t = cfg.hacpo, cfg.train
    _one_of("hacpo.algorithm", h.algorithm, ALGORITHMS)
    if h.algorithm in SHARING_ALGORITHMS:
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
    _rule(math.isfinite(h.kl_coef) and h.kl_coef >= 0, "hacpo.kl_coef", h.kl_coef,
          "must be a finite number >= 0 (0 turns the KL penalty off)")
    _one_of("hacpo.kl_estimator", h.kl_estimator, KL_ESTIMATORS)
    _one_of("train.minibatch_order", t.minibatch_order, MINIBATCH_ORDERS)
    _one_of("train.rollout_mode", t.rollout_mode, ROLLOUT_MODES)
    overlap = t.rollout_mode != "sync"
    _rule(not (overlap and cfg.rollout.colocate), "train.rollout_mode", t.rollout_mode,
          "rollout overlapping training needs engines on their own GPUs; rollout.colocate=true time-shares the "
          "trainer's GPUs: use train.rollout_mode=sync with it, or rollout.colocate=false")
    _rule(not (overlap and h.algorithm in TOKEN_LEVEL_ALGORITHMS), "train.rollout_mode", t.rollout_mode,
          f"the staleness correction is sequence-level (docs/algorithm.md §7b); hacpo.algorithm={h.algorithm} is "
          "token-level: use train.rollout_mode=sync with it")
    _rule(h.sgt_success_threshold <= h.max_reward, "hacpo.sgt_success_threshold", h.sgt_success_threshold,
          f"must be <= hacpo.max_reward={h.max_reward:g}: a success needs R >= the threshold, and no reward "
          "exceeds max_reward (docs/algorithm.md §8a)")
    _rule(h.adaptive_window_steps >= 1, "hacpo.adaptive_window_steps", h.adaptive_window_steps,
          "must be >= 1 (steps of the adaptive window's running median)")
    _rule(h.cross_window == "fixed" or h.cross_clip, "hacpo.cross_window", h.cross_window,
          "the adaptive window moves the cross clip window; it needs hacpo.cross_clip=true")
    _rule(h.cross_window == "fixed" or h.cross_clip_mode in ("clamp", "pessimistic"), "hacpo.cross_window",
          h.cross_window, f"the adaptive window centres HACPO's window [lb_m, 1]; hacpo.cross_clip_mode="
          f"{h.cross_clip_mode} uses GSPO's window instead (docs/algorithm.md §5c-5d): use hacpo.cross_window=fixed "
          "with it")
    validate_rollout(cfg)
    _rule(t.steps >= 0, "train.steps", t.steps, "must be >= 0")
    _rule(t.prompts_per_step >= 1, "train.prompts_per_step", t.prompts_per_step, "must be >= 1")
    _rule(t.mini_batches >= 1, "train.mini_batches", t.mini_batches, "must be >= 1")
    _rule(t.prompts_per_step % t.mini_batches == 0, "train.mini_batches", t.mini_batches,
          f"must divide train.prompts_per_step={t.prompts_per_step} (the step's sequences are shuffled and split into M equal mini-batches)")
    _rule(t.micro_batch_size >= 1, "train.micro_batch_size", t.micro_batch_size, "must be >= 1")
    validate_token_budget(cfg)
    validate_row_geometry(cfg)
    _rule(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 disables)")
    _rule(t.lr_schedule in ("constant", "cosine"), "train.lr_schedule", t.lr_schedule,
          "must be one of ['constant', 'cosine']")
    _rule(t.eval_every >= 0, "train.eval_every", t.eval_every, "must be >= 0")
    _rule(t.eval_temperature > 0 or t.eval_samples == 1, "train.eval_samples", t.eval_samples,
          "greedy evaluation (train.eval_temperature=0) gives k identical samples: set train.eval_temperature > 0 "
          "(e.g. 1.0) for avg@k and pass@k with k > 1")
    _rule(t.cpu_threads >= 0, "train.cpu_threads", t.cpu_threads, "must be >= 0 (0: torch default)")
    _rule(t.verifier_workers >= 0, "train.verifier_workers", t.verifier_workers, "must be >= 0")
    _rule(t.verifier_timeout_s > 0, "train.verifier_timeout_s", t.verifier_timeout_s, "must be > 0")
    _one_of("train.verifier_mode", t.verifier_mode, ("math", "math_verify"))
    _rule(cfg.data.difficulty >= 1, "data.difficulty", cfg.data.difficulty, "must be >= 1")
    validate_data_names(cfg.data)
    _rule(cfg.data.eval_size >= 0, "data.eval_size", cfg.data.eval_size, "must be >= 0")
    _rule(cfg.checkpoint.every >= 0, "checkpoint.every", cfg.checkpoint.every, "must be >= 0")
    _rule(cfg.checkpoint.keep >= 1, "checkpoint.keep", cfg.checkpoint.keep, "must be >= 1")
    for tag in cfg.log.wandb_tags:
        _rule(0 < len(tag) <= 64, "log.wandb_tags", cfg.log.wandb_tags, f"tag {tag!r} must be 1 to 64 characters "
              "(wandb's limit)")
    validate_exchange(cfg)
    _rule(not cfg.checkpoint.export_best or (t.eval_every > 0 and (cfg.data.eval_size > 0 or cfg.data.eval_benchmarks)),
          "checkpoint.export_best", True, "needs evaluations to pick the best step: train.eval_every > 0 and "
          "data.eval_size > 0 or data.eval_benchmarks")


def validate_token_budget(cfg: ExperimentConfig) -> None:
    """``train.max_tokens_per_microbatch`` must hold the longest sequence a rollout can make (a sequence is
    never split across micro-batches), and ``train.pack_sequences`` needs that budget (it packs up to it)."""
    t, r = cfg.train, cfg.rollout
    _rule(t.max_tokens_per_microbatch >= 0, "train.max_tokens_per_microbatch", t.max_tokens_per_microbatch,
          "must be >= 0 (0: micro-batches of train.micro_batch_size sequences)")
    longest = r.max_prompt_len + r.max_response_len
    _rule(t.max_tokens_per_microbatch == 0 or t.max_tokens_per_microbatch >= longest, "train.max_tokens_per_microbatch",
          t.max_tokens_per_microbatch, f"must hold the longest sequence, rollout.max_prompt_len + max_response_len = "
          f"{longest} tokens (a sequence is never split across micro-batches)")
    _rule(not t.pack_sequences or t.max_tokens_per_microbatch > 0, "train.pack_sequences", t.pack_sequences,
          "packs sequences up to a token budget: set train.max_tokens_per_microbatch (e.g. "
          f"{max(4 * longest, 512)})")
