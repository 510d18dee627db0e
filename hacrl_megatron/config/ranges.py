"""Every configuration field's real range, checked up front (pure: no file access).

:data:`NUMBERS` gives each numeric field its interval and the reason for it, :data:`TEXTS` each
free-text field its rule (names short enough for file names, paths the filesystem can hold,
templates with a ``{question}``); enumerations are checked by :mod:`.validation`. Fields are named
by dotted patterns, ``*`` standing for a list index (``agents.*.lr``). A value outside its range
(NaN and ±inf included) raises :class:`ConfigError` naming the field, the value and the reason,
before any work: a ``rollout.samples_per_prompt`` of 10^9 or an ``agents.0.lr`` of inf never
reaches the first rollout. ``tests/faults/test_config_fuzz.py`` checks that every numeric and
text field of the schema has an entry here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hacrl_megatron.config.bounded_yaml import short_repr
from hacrl_megatron.config.schema import ConfigError
from hacrl_megatron.outputs import path_problem

MAX_NAME = 64  # agent names: folders final/<name>, warm-up <name>-<hash>, temp .<name>.tmp<pid>
MAX_RUN_NAME = 128  # the run's name (progress bar, wandb run; wandb's limit is 128)
MAX_SEQUENCES_PER_STEP = 1 << 20  # sequences an agent generates and holds in memory in one step
SEED_MAX = 2**32 - 1  # Python's and numpy's RNG seeds


@dataclass(frozen=True)
class Interval:
    """A closed (or, with ``*_open``, open) interval of finite numbers; None: unbounded on that side."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""

    def describe(self, value: float) -> str:
        """The rule ``value`` breaks, on the side it breaks it: ``must be >= 1``, ``must be < 1``."""
        if not math.isfinite(value):
            return "must be a finite number" + ("" if self.low is None else f" in {self._interval()}")
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return f"must be {'>' if self.low_open else '>='} {self.low:g}"
        return f"must be {'<' if self.high_open else '<='} {self.high:g}"

    def _interval(self) -> str:
        high = "inf)" if self.high is None else f"{self.high:g}{')' if self.high_open else ']'}"
        return f"{'(' if self.low_open else '['}{self.low:g}, {high}"

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or (value < self.high or (not self.high_open and value == self.high))


def _i(low: float, high: float | None = None, why: str = "", **open_: bool) -> Interval:
    return Interval(low, high, why=why, **open_)


NUMBERS: dict[str, Interval] = {
    "agents.*.model.hidden_size": _i(1, 1 << 17, "model width; the largest released models use 16384"),
    "agents.*.model.num_layers": _i(1, 1024, "transformer layers (the largest released models use 126)"),
    "agents.*.model.num_heads": _i(1, 1024, "attention heads"),
    "agents.*.model.num_kv_heads": _i(1, 1024, "KV heads"),
    "agents.*.model.ffn_hidden_size": _i(1, 1 << 20, "SwiGLU width"),
    "agents.*.model.vocab_size": _i(1, 1 << 22, "tokens; at least the tokenizer's size (checked at build)"),
    "agents.*.model.max_position_embeddings": _i(1, 1 << 22, "positions (tokens of context)"),
    "agents.*.model.rope_theta": _i(0, None, "RoPE base", low_open=True),
    "agents.*.model.rms_norm_eps": _i(0, 1, "RMSNorm's epsilon (1e-6 typical)", low_open=True, high_open=True),
    "agents.*.model.num_experts": _i(0, 1024, "routed experts per layer (0: dense)"),
    "agents.*.model.moe_topk": _i(1, 1024, "experts per token"),
    "agents.*.model.moe_ffn_hidden_size": _i(0, 1 << 20, "expert width (0: ffn_hidden_size)"),
    "agents.*.model.shared_expert_ffn_hidden_size": _i(0, 1 << 20, "shared expert width (0: none)"),
    "agents.*.model.moe_aux_loss_coeff": _i(0, 1, "a coefficient on a loss of order 1 (1e-2 typical)"),
    "agents.*.model.moe_z_loss_coeff": _i(0, 1, "a coefficient on a loss of order 1 (1e-3 typical)"),
    "agents.*.parallel.tp": _i(1, 65536, "ranks"),
    "agents.*.parallel.pp": _i(1, 65536, "ranks"),
    "agents.*.parallel.dp": _i(1, 65536, "ranks"),
    "agents.*.parallel.ep": _i(1, 65536, "ranks"),
    "agents.*.parallel.etp": _i(1, 65536, "ranks"),
    "agents.*.parallel.cp": _i(1, 65536, "ranks"),
    "agents.*.parallel.ddp_bucket_mb": _i(0, 1 << 20, "MiB of gradients per bucket (0: megatron's default)"),
    "agents.*.lr": _i(0, 1, "an Adam update moves every weight by about lr: above 1 one update destroys the "
                            "model (the paper uses 1e-6)", low_open=True),
    "agents.*.warmup_sft_lr": _i(0, 1, "an Adam update moves every weight by about lr", low_open=True),
    "agents.*.warmup_sft_target": _i(0, 1, "a greedy accuracy"),
    "agents.*.warmup_sft_max_steps": _i(1, None, "updates"),
    "agents.*.warmup_sft_batch": _i(1, 1 << 16, "sequences per warm-up update, held in memory at once"),
    "agents.*.warmup_sft_eval_every": _i(1, None, "warm-up updates between accuracy checks"),
    "agents.*.rollout_gpu_ids.*": _i(0, 65535, "a GPU index"),
    "rollout.samples_per_prompt": _i(2, 1024, "G responses per prompt are generated and held in memory at once "
                                              "(the paper uses 8); group baselines need two"),
    "rollout.temperature": _i(0, None, "sampling temperature", low_open=True),
    "rollout.top_p": _i(0, 1, "nucleus probability mass", low_open=True),
    "rollout.max_prompt_len": _i(1, 1 << 20, "tokens"),
    "rollout.max_response_len": _i(1, 1 << 20, "tokens generated per response"),
    "rollout.hf.max_batch_size": _i(1, 1 << 16, "sequences per generate call, held in memory at once"),
    "rollout.sglang.tp": _i(1, 1024, "GPUs of one server"),
    "rollout.sglang.mem_fraction": _i(0, 1, "a share of each GPU", low_open=True, high_open=True),
    "rollout.vllm.tp": _i(1, 1024, "GPUs of one server"),
    "rollout.vllm.gpu_memory_utilization": _i(0, 1, "a share of each GPU", low_open=True, high_open=True),
    "rollout.vllm.cpu_kv_cache_gib": _i(1, 1 << 16, "GiB of host memory for a CPU server's KV cache"),
    "rollout.vllm.max_model_len": _i(0, 1 << 22, "tokens of context (0: the model's own)"),
    "rollout.vllm.max_num_seqs": _i(0, 1 << 20, "sequences one server decodes at once (0: vLLM's default)"),
    "rollout.weight_sync_bucket_mb": _i(1, 65536, "MiB per bucket; two buckets are held in GPU memory"),
    "hacpo.alpha": _i(0, 100, "the exponent of the cross ratio, eq. 13 (the paper uses 0-3); the gradient grows "
                              "with 1 + α"),
    "hacpo.cross_clip_low": _i(0, 1, "1 − δ, eq. 14", low_open=True),
    "hacpo.delta_step": _i(0, 1, "the window's lower bound rises by this per update, up to 1"),
    "hacpo.self_clip_low": _i(0, 1, "ε_low", high_open=True),
    "hacpo.self_clip_high": _i(0, None, "ε_high"),
    "hacpo.grpo_clip_low": _i(0, 1, "ε_low", high_open=True),
    "hacpo.grpo_clip_high": _i(0, None, "ε_high"),
    "hacpo.capability_window": _i(1, 1_000_000, "steps of the moving average, eq. 8"),
    "hacpo.omega_min": _i(0, 1, "ω's lower clip, eq. 9", low_open=True),
    "hacpo.omega_max": _i(1, None, "ω's upper clip, eq. 9"),
    "hacpo.max_reward": _i(0, None, "rewards lie in [0, max_reward]", low_open=True),
    "hacpo.max_abs_log_ratio": _i(0, 80, "exp(|log s|) must stay finite in float32 (e^88.7 overflows)",
                                  low_open=True),
    "hacpo.adaptive_window_steps": _i(1, 1_000_000, "steps of the running median"),
    "hacpo.kl_coef": _i(0, 10, "β of the KL penalty to the starting policy, a loss of order 1 (1e-3 typical)"),
    "hacpo.prp_max_weight": _i(0, None, "the cap C of a peer response's density-ratio weight (docs/algorithm.md §8a)",
                               low_open=True),
    "hacpo.sgt_coef": _i(0, 100, "λ, the advantage of a transferred peer success, of the order of a standardised "
                                 "advantage (docs/algorithm.md §8a)"),
    "hacpo.sgt_success_threshold": _i(0, None, "a reward; a zero reward is never a success", low_open=True),
    "hacpo.ftis_truncation": _i(0, None, "C of the truncated importance weight min(s_old, C)", low_open=True),
    "hacpo.ftis_kl_threshold": _i(0, None, "nats per token of −log s_old (0: any negative peer response the learner "
                                           "likes less than its author is filtered)"),
    "train.steps": _i(0, None, "steps"),
    "train.prompts_per_step": _i(1, 1 << 16, "B prompts per step"),
    "train.mini_batches": _i(1, None, "M updates per step"),
    "train.max_staleness": _i(1, 16, "weight versions an async batch may lag; each keeps a host copy of the weights"),
    "train.micro_batch_size": _i(1, None, "sequences per forward/backward"),
    "train.max_tokens_per_microbatch": _i(0, 1 << 24, "tokens per forward/backward (0: count sequences)"),
    "train.weight_decay": _i(0, 1, "decoupled weight decay: each update multiplies the weights by 1 − lr·wd"),
    "train.grad_clip": _i(0, None, "a gradient norm (0 disables clipping)"),
    "train.adam_beta1": _i(0, 1, "Adam's decay of the first moment", high_open=True),
    "train.adam_beta2": _i(0, 1, "Adam's decay of the second moment", high_open=True),
    "train.lr_warmup_steps": _i(0, None, "updates"),
    "train.eval_every": _i(0, None, "steps (0: never)"),
    "train.eval_samples": _i(1, 1024, "k samples per benchmark problem, generated and held in memory at once"),
    "train.eval_temperature": _i(0, 10, "sampling temperature of the evaluation (0: greedy)"),
    "train.seed": _i(0, SEED_MAX, "Python's and numpy's RNG seeds"),
    "train.cpu_threads": _i(0, 1024, "threads"),
    "train.verifier_workers": _i(0, 256, "processes started at once"),
    "train.verifier_timeout_s": _i(0, 3600, "seconds one response may take to score; a checker that never "
                                            "answers stops the run after a few of these", low_open=True),
    "data.difficulty": _i(1, None, "the procedural knob (each task checks its own maximum)"),
    "data.eval_size": _i(0, 1_000_000, "evaluation prompts, generated and held in memory"),
    "data.eval_limit": _i(0, 1_000_000, "problems per benchmark (0: all), held in memory"),
    "data.reward_range.*": _i(-1e9, 1e9, "the checker's reward bounds"),
    "data.seed": _i(0, SEED_MAX, "Python's and numpy's RNG seeds"),
    "checkpoint.every": _i(0, None, "steps (0: never)"),
    "checkpoint.keep": _i(1, None, "checkpoints"),
    "log.every": _i(1, None, "steps between metrics rows (the step number is divided by it)"),
    "log.samples_every": _i(0, None, "steps (0: never)"),
    "log.samples_prompts": _i(1, 4096, "prompts per samples file, each with every agent's completions"),
    "log.samples_max_chars": _i(1, 1_000_000, "characters kept of each completion's text"),
    "exchange.wait_s": _i(0, 7 * 86400, "seconds a step waits for its peers' records"),
    "exchange.keep_steps": _i(1, 1_000_000, "steps of its own records each job keeps"),
}


def _agent_name(value: str) -> str | None:
    if not (value.isascii() and value.isidentifier()):
        return "must be an ASCII identifier (letters, digits, _): it names metric keys and folders"
    if len(value) > MAX_NAME:
        return f"is {len(value)} characters long: at most {MAX_NAME}, it names folders (final/<name>, ...)"
    return None


def _run_name(value: str) -> str | None:
    if not value.strip() or len(value) > MAX_RUN_NAME:
        return f"must be 1 to {MAX_RUN_NAME} characters (it names the progress bar and the wandb run)"
    return None


def _optional_agent_name(value: str | None) -> str | None:
    return None if value is None else _agent_name(value)


def _tokenizer(value: str) -> str | None:
    return None if value in ("char", "pair", "smollm2") else path_problem(value)


def _template(value: str) -> str | None:
    if value in ("auto", "chat", "plain") or "{question}" in value:
        return None
    return "must be auto, chat, plain or a template containing {question}"


def _optional_path(value: str | None) -> str | None:
    problem = None if value is None else path_problem(value)
    return problem and f"{problem} (omit the field to use its default)"


def _sglang_python(value: str) -> str | None:
    return None if value == "" else path_problem(value)


def _hf_path(value: str | None) -> str | None:
    return None if value in (None, "smollm2") else _optional_path(value)


# a bind address each node resolves for itself (rollout/engine_actor.py, bind_host): the node's address as
# Ray knows it, or the IPv4 address of a named network interface on that node (e.g. {iface:ib0})
PER_NODE_HOST = re.compile(r"\{node_ip\}|\{iface:[A-Za-z0-9_.\-]{1,15}\}")


def _bind_host(value: str) -> str | None:
    """An address a server can bind: empty (the node's own), a per-node placeholder (``{node_ip}``,
    ``{iface:NAME}``) or an ASCII host name / IP of at most 253 chars."""
    if value == "" or PER_NODE_HOST.fullmatch(value):
        return None
    if len(value) > 253 or not value.isascii() or any(c.isspace() or c in "/:@" for c in value):
        return "must be empty (the node's address) or a host name or IPv4 address (ASCII, at most 253 characters)"
    return None


def _exchange_run_id(value: str) -> str | None:
    """Empty (the run's name) or a name for file names and Redis keys: letters, digits, ``._-``, 1-128 chars."""
    if value == "" or (len(value) <= 128 and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", value)):
        return None
    return ("must be empty (the run's name) or 1 to 128 characters of letters, digits, '.', '_' and '-' "
            "starting with a letter or digit (it names a folder and Redis keys)")


def _redis_url(value: str | None) -> str | None:
    if value is None:
        return None
    if (len(value) > 2048 or not value.isascii() or any(c.isspace() for c in value)
            or not re.match(r"rediss?://[^/]", value)):
        return ("must be redis://HOST:PORT/DB or rediss://HOST:PORT/DB (TLS): ASCII, no spaces, at most 2048 "
                "characters (omit the field when exchange.backend is not redis)")
    return None


def _wandb_project(value: str) -> str | None:
    return None if 0 < len(value) <= 128 else "must be 1 to 128 characters (wandb's limit)"


def _wandb_optional(value: str) -> str | None:
    return None if len(value) <= 128 else "must be at most 128 characters (wandb's limit; empty: wandb's default)"


# free-text fields (enumerations are checked in validation.py; data.path and data.checker there too)
TEXTS: dict[str, Callable[[Any], str | None]] = {
    "name": _run_name,
    "output_dir": path_problem,
    "agents.*.name": _agent_name,
    "agents.*.tokenizer": _tokenizer,
    "agents.*.prompt_template": _template,
    "agents.*.init_checkpoint": _optional_path,
    "agents.*.warmup_sft_from": _optional_agent_name,
    "agents.*.model.hf_path": _hf_path,
    "agents.*.model.gguf_file": _optional_path,
    "rollout.sglang.python": _sglang_python,
    "rollout.vllm.python": _sglang_python,  # the same rule: empty (the fallbacks) or a usable path
    "rollout.sglang.host": _bind_host,
    "rollout.sglang.api_key_file": _sglang_python,  # the same rule: empty (no key) or a usable path
    "checkpoint.dir": _optional_path,
    "log.wandb_project": _wandb_project,
    "log.wandb_entity": _wandb_optional,
    "log.wandb_group": _wandb_optional,
    "log.run_name": _wandb_optional,
    "exchange.dir": _optional_path,
    "exchange.redis_url": _redis_url,
    "exchange.redis_password_file": _optional_path,
    "exchange.redis_ca_file": _optional_path,
    "exchange.key_file": _optional_path,
    "exchange.run_id": _exchange_run_id,
}


def pattern_of(path: str) -> str:
    """``agents.0.lr`` → ``agents.*.lr``."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def flat_fields(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted path → leaf value of a config record (lists of records and of numbers are walked)."""
    if dataclasses.is_dataclass(value):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    elif isinstance(value, list) and not any(isinstance(v, str) for v in value):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, sub in items:
        out.update(flat_fields(sub, f"{prefix}.{key}" if prefix else key))
    return out


class RangeError(ConfigError):
    """A field outside its own range; ``field`` is its dotted path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def range_error(cfg: Any) -> RangeError | None:
    """The first field of ``cfg`` outside its :data:`NUMBERS` interval or breaking its :data:`TEXTS` rule."""
    for path, value in flat_fields(cfg).items():
        pattern = pattern_of(path)
        if pattern in NUMBERS and isinstance(value, (int, float)) and not isinstance(value, bool):
            interval = NUMBERS[pattern]
            if not interval.holds(value):
                return RangeError(path, f"{path}={short_repr(value)}: {interval.describe(value)} ({interval.why})")
        elif pattern in TEXTS:
            problem = TEXTS[pattern](value)
            if problem:
                return RangeError(path, f"{path}={short_repr(value)}: {problem}")
    return None


def validate_ranges(cfg: Any) -> None:
    """Check every field of ``cfg`` against :data:`NUMBERS` and :data:`TEXTS`, and the per-step size."""
    error = range_error(cfg)
    if error is not None:
        raise error
    for i, agent in enumerate(cfg.agents):
        if agent.model.gguf_file is not None and agent.model.hf_path is None:
            raise ConfigError(f"agents.{i}.model.gguf_file={agent.model.gguf_file!r}: needs model.hf_path (the "
                              "folder holding the GGUF file)")
    from hacrl_megatron.data.procedural import MAX_DIFFICULTY, TASKS

    if cfg.data.task in TASKS and cfg.data.difficulty > MAX_DIFFICULTY:
        raise ConfigError(f"data.difficulty={cfg.data.difficulty!r}: must lie in [1, {MAX_DIFFICULTY}] for the "
                          f"procedural task {cfg.data.task!r}")
    per_step = cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt * (
        2 if cfg.hacpo.algorithm == "gspo_x2" else 1)
    if per_step > MAX_SEQUENCES_PER_STEP:
        raise ConfigError(
            f"rollout.samples_per_prompt={cfg.rollout.samples_per_prompt!r}: train.prompts_per_step × "
            f"samples_per_prompt = {per_step} sequences per agent per step: at most {MAX_SEQUENCES_PER_STEP}, every "
            "one is generated and held in memory during the step")
