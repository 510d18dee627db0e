"""docs/reference.md, generated from the code: every configuration key (type, default, range or
allowed values, meaning), every metric name (unit, meaning), the run folder's layout, and the nearest
keys of verl, NeMo-RL and TRL.

    python -m hacrl_megatron.reference_docs --write     # regenerate docs/reference.md
    python -m hacrl_megatron.reference_docs --check     # exit 1 when the page is not current

A key's meaning is its comment in config/schema.py (the comment on its line and the comment lines that
continue it, or the comment lines right above a key that has none on its line); ranges come from
config/ranges.py, allowed values from the enumerations of config/schema.py; metrics from
metric_names.py. tests/unit/test_reference_docs.py fails when the page is not what this writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any

from hacrl_megatron.config import schema
from hacrl_megatron.config.loading import _strip_optional
from hacrl_megatron.config.ranges import NUMBERS, TEXTS
from hacrl_megatron.metric_names import METRICS

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"
ENUMS = {  # dotted pattern → the allowed values (validation.py checks them with _one_of)
    "agents.*.backend": schema.BACKENDS, "agents.*.workers": schema.WORKERS, "agents.*.model.arch": schema.ARCHS,
    "agents.*.model.dtype": schema.MODEL_DTYPES, "agents.*.parallel.recompute": schema.RECOMPUTE,
    "rollout.engine": schema.ENGINES, "rollout.eos_mode": schema.EOS_MODES,
    "rollout.weight_sync": schema.WEIGHT_SYNC_MODES, "rollout.vllm.dtype": schema.VLLM_DTYPES,
    "rollout.colocate_offload": schema.COLOCATE_OFFLOAD,
    "rollout.sglang.placement": ("local", "ray"), "hacpo.algorithm": schema.ALGORITHMS,
    "hacpo.cross_clip_mode": schema.CROSS_CLIP_MODES, "hacpo.cross_window": schema.CROSS_WINDOWS,
    "hacpo.kl_estimator": schema.KL_ESTIMATORS, "train.minibatch_order": schema.MINIBATCH_ORDERS,
    "train.rollout_mode": schema.ROLLOUT_MODES, "train.lr_schedule": ("constant", "cosine"),
    "train.verifier_mode": ("math", "math_verify"),
    "exchange.backend": schema.EXCHANGE_BACKENDS, "exchange.on_missing": schema.ON_MISSING,
}
# keys whose schema line has no comment (a new key without either fails tests/unit/test_reference_docs.py)
MEANINGS = {
    "name": "the run's name (progress bar, wandb run)",
    "output_dir": "the run folder: metrics, TensorBoard, samples, checkpoints, final weights (layout below)",
    "agents.N.name": "the agent's name: metric prefix and folder name",
    "agents.N.model.hidden_size": "model width (built models; read from hf_path otherwise)",
    "agents.N.model.num_layers": "transformer layers",
    "agents.N.model.num_heads": "attention heads",
    "agents.N.model.max_position_embeddings": "longest sequence (prompt + response) the model takes",
    "agents.N.model.rope_theta": "RoPE base frequency",
    "agents.N.model.rms_norm_eps": "RMSNorm epsilon",
    "agents.N.model.tie_embeddings": "input embedding and output head share their weights",
    "agents.N.warmup_sft_max_steps": "most updates of the supervised warm-up",
    "rollout.temperature": "sampling temperature of the rollouts (and of every log-prob pass)",
    "rollout.top_p": "nucleus sampling mass of the rollouts",
    "rollout.max_prompt_len": "prompt tokens kept (the left end is cut beyond)",
    "rollout.max_response_len": "tokens generated per response at most",
    "hacpo.omega_max": "upper clip of the capability ratio ω (eq. 9)",
    "hacpo.max_reward": "the largest reward, for the baseline guard (rewards are in [0, max_reward])",
    "train.steps": "RL steps of the run",
    "train.weight_decay": "AdamW decoupled weight decay",
    "train.grad_clip": "gradient-norm clip (0: off)",
    "train.adam_beta1": "Adam β1",
    "train.adam_beta2": "Adam β2",
    "train.lr_warmup_steps": "updates of linear learning-rate warm-up",
    "train.seed": "seed of sampling, shuffling and initialisation",
    "train.verifier_timeout_s": "seconds one response may take to score (a hang scores 0)",
    "data.eval_size": "held-out prompts of the task evaluated greedily every train.eval_every steps (0: none)",
    "data.seed": "seed of the data: procedural problems, dataset shuffles and held-out split",
    "checkpoint.resume": "continue the run in output_dir from its newest checkpoint (same configuration)",
    "log.jsonl": "write metrics.jsonl",
    "log.tensorboard": "write TensorBoard events (tensorboard/)",
    "log.wandb": "log to Weights & Biases (needs wandb installed)",
    "log.wandb_project": "the wandb project",
    "log.progress": "show a progress bar",
    "log.every": "steps between metrics.jsonl rows",
}
RUN_LAYOUT = (
    ("run.json", "the run's id and configuration (a resume is compared with it)"),
    (".hacrl.lock", "held while a run uses the folder"),
    ("metrics.jsonl", "one JSON object per logged step: the metrics below"),
    ("tensorboard/", "TensorBoard events (log.tensorboard): the metrics and a text panel of samples"),
    ("samples/step-NNNNNN.jsonl", "the step's generations (log.samples_every; `hacrl samples RUN`)"),
    ("checkpoints/step-NNNNNN/", "joint checkpoint of every agent, the capability tracker, the data position and "
                                 "RNG (checkpoint.every, checkpoint.keep newest; checkpoint.dir moves them)"),
    ("final/<agent>/", "each agent's last weights as a standalone HF folder (config, safetensors, tokenizer)"),
    ("best/<agent>/", "each agent at its best evaluation, with hacrl_best.json (checkpoint.export_best)"),
    ("abandoned-<UTC time>/", "what a run that stopped before its first checkpoint left, kept when a new run "
                              "took the folder over"),
)
# (verl, NeMo-RL, TRL GRPOConfig, ours): the nearest equivalents; "–" where a framework has none
KEY_MAP = (
    ("data.train_files", "data.dataset_name", "train_dataset (argument)", "data.path (data.task=custom)"),
    ("data.val_files", "data.val_dataset_name", "eval_dataset (argument)",
     "data.eval_benchmarks, data.benchmark_paths"),
    ("data.prompt_key", "–", "– (column prompt)", "data.prompt_key"),
    ("reward_model.ground_truth (column)", "–", "– (extra columns)", "data.answer_key"),
    ("custom_reward_function.path / .name", "env / reward function", "reward_funcs", "data.checker (FILE.py:NAME)"),
    ("data.train_batch_size", "grpo.num_prompts_per_step", "per_device_train_batch_size × devices / num_generations",
     "train.prompts_per_step"),
    ("actor_rollout_ref.rollout.n", "grpo.num_generations_per_prompt", "num_generations", "rollout.samples_per_prompt"),
    ("data.max_prompt_length", "–", "max_prompt_length", "rollout.max_prompt_len"),
    ("data.max_response_length", "policy.generation.max_new_tokens", "max_completion_length",
     "rollout.max_response_len"),
    ("actor_rollout_ref.rollout.temperature", "policy.generation.temperature", "temperature", "rollout.temperature"),
    ("actor_rollout_ref.rollout.top_p", "policy.generation.top_p", "top_p", "rollout.top_p"),
    ("actor_rollout_ref.rollout.name", "policy.generation.backend", "use_vllm", "rollout.engine"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size", "policy.generation.vllm_cfg.tensor_parallel_size",
     "vllm_tensor_parallel_size", "rollout.sglang.tp / rollout.vllm.tp"),
    ("actor_rollout_ref.model.path", "policy.model_name", "model (argument)", "agents.N.model.hf_path"),
    ("actor_rollout_ref.actor.optim.lr", "policy.optimizer.kwargs.lr", "learning_rate", "agents.N.lr"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", "policy.train_global_batch_size", "steps_per_generation",
     "train.mini_batches (M = prompts_per_step / mini-batch prompts)"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "policy.train_micro_batch_size",
     "per_device_train_batch_size", "train.micro_batch_size"),
    ("actor_rollout_ref.actor.grad_clip", "policy.max_grad_norm", "max_grad_norm", "train.grad_clip"),
    ("actor_rollout_ref.actor.clip_ratio_low / _high", "loss_fn.ratio_clip_min / _max", "epsilon / epsilon_high",
     "hacpo.grpo_clip_low / _high (GSPO: hacpo.self_clip_low / _high)"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "loss_fn.sequence_level_importance_ratios",
     "importance_sampling_level=sequence", "hacpo.algorithm=gspo"),
    ("algorithm.adv_estimator=grpo", "(GRPO)", "(GRPOTrainer)", "hacpo.algorithm=grpo"),
    ("actor_rollout_ref.actor.kl_loss_coef (use_kl_loss)", "loss_fn.reference_policy_kl_penalty", "beta",
     "hacpo.kl_coef"),
    ("actor_rollout_ref.actor.kl_loss_type", "–", "–", "hacpo.kl_estimator"),
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
     "policy.megatron_cfg.tensor_model_parallel_size", "–", "agents.N.parallel.tp"),
    ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
     "policy.megatron_cfg.pipeline_model_parallel_size", "–", "agents.N.parallel.pp"),
    ("trainer.total_training_steps", "grpo.max_num_steps", "max_steps", "train.steps"),
    ("trainer.test_freq", "grpo.val_period", "eval_steps", "train.eval_every"),
    ("trainer.save_freq", "checkpointing.save_period", "save_steps", "checkpoint.every"),
    ("trainer.max_actor_ckpt_to_keep", "checkpointing.keep_top_k", "save_total_limit", "checkpoint.keep"),
    ("trainer.resume_mode", "(resumes from checkpoint_dir)", "resume_from_checkpoint", "checkpoint.resume"),
    ("trainer.default_local_dir", "checkpointing.checkpoint_dir", "output_dir", "output_dir (checkpoint.dir)"),
    ("trainer.project_name", "logger.wandb.project", "(WANDB_PROJECT)", "log.wandb_project"),
    ("trainer.experiment_name", "logger.wandb.name", "run_name", "log.run_name (else name)"),
    ("trainer.logger=[wandb]", "logger.wandb_enabled", "report_to=wandb", "log.wandb"),
    ("trainer.log_val_generations", "logger.num_val_samples_to_print", "log_completions", "log.samples_every"),
    ("data.seed", "grpo.seed", "seed", "train.seed (data.seed: the data order)"),
)


def _field_comments(cls: type) -> dict[str, str]:
    """Field name → its comment in the source of dataclass ``cls`` (see the module docstring)."""
    import inspect

    source = inspect.getsource(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    lines: dict[int, tuple[str | None, str | None, bool]] = {}  # line → (field, comment, comment-only)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        row = tok.start[0]
        field, comment, only = lines.get(row, (None, None, True))
        if tok.type == tokenize.COMMENT:
            comment = tok.string.lstrip("#").strip()
        elif tok.type == tokenize.NAME and only and tok.start[1] == 4 and tok.string in names:
            field, only = tok.string, False
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            only = False
        lines[row] = (field, comment, only)
    out: dict[str, list[str]] = {}
    current, continuing, pending = None, False, []
    for row in sorted(lines):
        field, comment, only = lines[row]
        if field is not None:  # a comment block right above a field is its comment (with its own, if any)
            out[field] = pending + ([comment] if comment else [])
            current, continuing, pending = field, comment is not None, []
        elif only and comment is not None:
            if continuing and current is not None and _continues(" ".join(out[current]), comment):
                out[current].append(comment)
            else:
                pending.append(comment)
                continuing = False
        elif only:  # a blank line ends a comment
            continuing = False
        else:
            current, continuing, pending = None, False, []
    return {name: " ".join(parts) for name, parts in out.items()}


def _continues(text: str, line: str) -> bool:
    """Whether comment ``line`` continues ``text`` (a field's comment so far) rather than starting the
    comment of the next field: an open bracket, a trailing separator, or a sentence going on in lowercase."""
    if text.count("(") > text.count(")") or text.count("[") > text.count("]"):
        return True
    return bool(text) and (text[-1] in ",;:|(-–/" or (text[-1].isalnum() and line[:1].islower()))


def _type_name(tp: Any) -> str:
    inner, optional = _strip_optional(tp)
    name = getattr(inner, "__name__", str(inner)).replace("typing.", "")
    if typing.get_origin(inner) in (list, dict):
        name = str(inner).replace("typing.", "")
    return name + (" | None" if optional else "")


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def _text_rule(check: Any) -> str:
    """A text field's rule in words, from what its check says about hostile values."""
    said = {v: check(v) for v in ("", "x" * 5000)}
    if any(m and "4095 bytes" in m for m in said.values()):
        rule = "a path of at most 4,095 bytes"
        if said[""] is None:
            return rule + ", or empty"
        return rule + (", or null" if "omit the field" in (said[""] or "") else "")
    first = next(m for m in said.values() if m)
    return first.removeprefix("must be ")


def _rule(pattern: str, value: Any) -> str:
    if pattern in NUMBERS:
        interval = NUMBERS[pattern]
        low = "−∞" if interval.low is None else _number(interval.low)
        high = "∞" if interval.high is None else _number(interval.high)
        return f"{'(' if interval.low_open else '['}{low}, {high}{')' if interval.high_open else ']'}"
    if pattern in ENUMS:
        return " \\| ".join(ENUMS[pattern])
    if pattern in TEXTS:
        return _text_rule(TEXTS[pattern])
    if isinstance(value, bool):
        return "true \\| false"
    return ""


def config_rows(cls: type = schema.ExperimentConfig, prefix: str = "", pattern: str = "") -> list[tuple[str, ...]]:
    """(key, type, default, range, meaning) of every field of ``cls``, nested sections walked."""
    rows: list[tuple[str, ...]] = []
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp, _ = _strip_optional(hints[f.name])
        key, pat = f"{prefix}{f.name}", f"{pattern}{f.name}"
        value = getattr(defaults, f.name)
        if f.name == "agents":
            rows.append((key, "list of agents", "two agents a, b", "", comments.get(f.name, "") or
                         "the agents, each a section agents.N.* below"))
            rows.extend(config_rows(schema.AgentConfig, "agents.N.", "agents.*."))
        elif dataclasses.is_dataclass(tp):
            rows.extend(config_rows(tp, key + ".", pat + "."))
        else:
            rule = _rule(pat + ".*" if pat + ".*" in NUMBERS else pat, value)
            rows.append((key, _type_name(hints[f.name]), _default(value), rule,
                         comments.get(f.name) or MEANINGS.get(key, "")))
    return rows


def _default(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value).replace("'", '"')


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") if "\\|" not in text else text


def render() -> str:
    """The whole page."""
    out = io.StringIO()
    w = out.write
    w("# Reference\n\nGenerated by `python -m hacrl_megatron.reference_docs --write` from the code "
      "(config/schema.py, config/ranges.py, metric_names.py); a test fails when it is not current.\n\n")
    w("## Configuration keys\n\nSet in a preset (YAML) or as `dotted.key=value` overrides; `agents.N` is the "
      "N-th agent. Ranges are closed unless shown open; `hacrl config` checks every one before any work.\n\n")
    w("| key | type | default | range / values | meaning |\n|---|---|---|---|---|\n")
    for row in config_rows():
        w("| " + " | ".join(f"`{row[0]}`" if i == 0 else _cell(c) for i, c in enumerate(row)) + " |\n")
    w("\n## Metrics\n\nLogged to metrics.jsonl (one row per logged step), TensorBoard and wandb. `<agent>` is the "
      "learner, `<source>` another agent whose responses it trains on; `<agent>/hacpo/*` are means over the "
      "step's mini-batch updates.\n\n| name | unit | meaning |\n|---|---|---|\n")
    for name, unit, meaning in METRICS:
        w(f"| `{name}` | {unit} | {_cell(meaning)} |\n")
    w("\n## Run folder (`output_dir`)\n\n| path | what |\n|---|---|\n")
    for path, what in RUN_LAYOUT:
        w(f"| `{path}` | {_cell(what)} |\n")
    w("\n## Keys of other frameworks\n\nThe nearest key of ours; semantics differ in places (HACPO trains n agents "
      "on each other's responses: the batch and mini-batch keys count prompts of one agent).\n\n"
      "| verl | NeMo-RL | TRL (GRPOConfig) | hacrl |\n|---|---|---|---|\n")
    for row in KEY_MAP:
        w("| " + " | ".join(f"`{c}`" if c not in ("–",) and not c.startswith("(") else c for c in row) + " |\n")
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write or check docs/reference.md")
    p.add_argument("--write", action="store_true", help="regenerate the page")
    p.add_argument("--check", action="store_true", help="exit 1 when the page is not current")
    args = p.parse_args(argv)
    text = render()
    if args.write:
        PAGE.write_text(text, encoding="utf-8")
        print(f"wrote {PAGE}")
        return 0
    current = PAGE.is_file() and PAGE.read_text(encoding="utf-8") == text
    if args.check and not current:
        print(f"{PAGE} is not current: run python -m hacrl_megatron.reference_docs --write", file=sys.stderr)
        return 1
    if not args.check:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
