"""A fuzz test over the configuration schema: every numeric field gets NaN, ±inf, 0, −1 and 10^12,
every text field the empty string, 300 characters and a non-ASCII one, each through `hacrl config`.
Each value is either refused with exit 2 and one line naming the field, or accepted; the accepted
ones must be exactly :data:`ACCEPTED`, and the slow step runs them (a 1-step run each group).

A new field fails :func:`test_every_field_has_a_declared_range` until it is given its range in
``hacrl_megatron/config/ranges.py`` (or is an enumeration checked by validation.py).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import pytest
import yaml

from hacrl_megatron.cli import main
from hacrl_megatron.config import AgentConfig, ExperimentConfig, load_config
from hacrl_megatron.config.bounded_yaml import short_repr
from hacrl_megatron.config.loading import _strip_optional
from hacrl_megatron.config.ranges import NUMBERS, TEXTS, pattern_of
from hacrl_megatron.trainer import loop
from hacrl_megatron.trainer.run_folder import checkpoint_dir
from tests.faults.trainer_helpers import tiny

NUMBERS_TRIED = (".nan", ".inf", "-.inf", "0", "-1", "1000000000000")
LONG, NON_ASCII = "x" * 300, "é"
TEXTS_TRIED = ('""', LONG, NON_ASCII)
# fields whose every allowed value is listed in validation.py (one_of), or read by their own checks
ENUMERATIONS = {"agents.*.backend", "agents.*.workers", "agents.*.model.arch", "agents.*.model.dtype",
                "agents.*.parallel.recompute", "rollout.engine", "rollout.eos_mode", "rollout.weight_sync",
                "hacpo.algorithm", "hacpo.cross_clip_mode", "hacpo.cross_window", "train.lr_schedule",
                "train.verifier_mode", "train.minibatch_order", "hacpo.kl_estimator", "data.task", "data.path",
                "data.checker", "rollout.vllm.dtype", "train.rollout_mode", "rollout.sglang.placement",
                "data.prompt_key", "data.answer_key", "exchange.backend", "exchange.on_missing",
                "rollout.colocate_offload"}
# hostile values inside their field's real range: each works (test_accepted_values_run_one_step)
ACCEPTED = {
    "0": {"agents.0.model.num_experts", "agents.0.model.moe_ffn_hidden_size",
          "agents.0.model.shared_expert_ffn_hidden_size", "agents.0.model.moe_aux_loss_coeff",
          "agents.0.model.moe_z_loss_coeff", "agents.0.warmup_sft_target", "hacpo.alpha", "hacpo.delta_step",
          "hacpo.kl_coef", "hacpo.sgt_coef", "hacpo.ftis_kl_threshold",
          "hacpo.self_clip_low", "hacpo.self_clip_high", "hacpo.grpo_clip_low", "hacpo.grpo_clip_high",
          "train.steps", "train.weight_decay", "train.grad_clip", "train.adam_beta1", "train.adam_beta2",
          "train.lr_warmup_steps", "train.eval_every", "train.seed", "train.cpu_threads", "train.verifier_workers",
          "data.eval_size", "data.eval_limit", "train.eval_temperature", "data.seed", "checkpoint.every",
          "log.samples_every", "exchange.wait_s",
          "rollout.vllm.max_model_len",
          "rollout.vllm.max_num_seqs", "agents.0.parallel.ddp_bucket_mb", "train.max_tokens_per_microbatch"},
    "1000000000000": {"agents.0.model.rope_theta", "agents.0.warmup_sft_max_steps", "agents.0.warmup_sft_eval_every",
                      "rollout.temperature",
                      "hacpo.self_clip_high", "hacpo.grpo_clip_high", "hacpo.omega_max", "hacpo.max_reward",
                      "hacpo.prp_max_weight", "hacpo.ftis_truncation", "hacpo.ftis_kl_threshold",
                      "train.steps", "train.micro_batch_size", "train.grad_clip", "train.lr_warmup_steps",
                      "train.eval_every", "checkpoint.every", "checkpoint.keep", "log.every", "log.samples_every"},
    '""': {"rollout.sglang.python", "rollout.vllm.python", "rollout.sglang.host", "rollout.sglang.api_key_file",
           "log.wandb_entity", "log.wandb_group", "log.run_name", "exchange.run_id"},
    NON_ASCII: {"name", "output_dir", "checkpoint.dir", "rollout.sglang.python", "rollout.vllm.python",
                "rollout.sglang.api_key_file", "log.wandb_project", "log.wandb_entity", "log.wandb_group", "log.run_name",
                "exchange.dir", "exchange.key_file", "exchange.redis_ca_file", "exchange.redis_password_file"},
}


def schema_fields(cls: type = ExperimentConfig, prefix: str = "") -> dict[str, type]:
    """Dotted path → type of every scalar field (the first agent stands for all)."""
    out: dict[str, type] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _strip_optional(hints[f.name])
        path = f"{prefix}{f.name}"
        if path == "agents":
            out.update(schema_fields(AgentConfig, "agents.0."))
        elif dataclasses.is_dataclass(tp):
            out.update(schema_fields(tp, path + "."))
        elif tp in (int, float, str):
            out[path] = tp
    return out


def _changed(value: dict, default: dict) -> dict:
    """The entries of ``value`` that differ from ``default`` (records compared field by field)."""
    out = {}
    for key, item in value.items():
        if isinstance(item, dict) and isinstance(default.get(key), dict):
            if item != default[key]:
                out[key] = _changed(item, default[key])
        elif item != default.get(key):
            out[key] = item
    return out


@pytest.fixture(scope="module")
def preset(tmp_path_factory) -> str:
    """The tiny two-agent run as a preset holding only what differs from the defaults: a short YAML
    file, so that the ~600 `hacrl config` calls below stay fast (YAML parsing is most of their time)."""
    tmp = tmp_path_factory.mktemp("fuzz")
    exp = tiny(tmp, steps=1, every=1)
    data = _changed(exp.to_dict(), ExperimentConfig().to_dict())
    data["agents"] = [_changed(a, dataclasses.asdict(AgentConfig())) for a in exp.to_dict()["agents"]]
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_config(str(path)) == exp
    return str(path)


def _values(tp: type) -> tuple[str, ...]:
    return TEXTS_TRIED if tp is str else NUMBERS_TRIED


def test_every_field_has_a_declared_range():
    missing = [path for path, tp in schema_fields().items()
               if pattern_of(path) not in (NUMBERS if tp in (int, float) else {**TEXTS, **dict.fromkeys(ENUMERATIONS)})]
    assert not missing, f"fields without a range in config/ranges.py: {missing}"


def test_hostile_values_are_refused_naming_the_field_or_accepted(preset, capsys):
    accepted: dict[str, set[str]] = {}
    unnamed = []
    for path, tp in schema_fields().items():
        for value in _values(tp):
            rc = main(["config", "--preset", preset, f"{path}={value}"])
            err = capsys.readouterr().err
            if rc == 0:
                accepted.setdefault(value, set()).add(path)
                continue
            lines = err.strip().splitlines()
            if rc != 2 or len(lines) != 1 or f"{path}=" not in lines[0] and f"{path}:" not in lines[0]:
                unnamed.append(f"{path}={value[:12]}: rc {rc}: {err.strip()[:200]}")
    assert not unnamed, "refused without naming the field in one line:\n" + "\n".join(unnamed)
    assert accepted == ACCEPTED


def _accepted_runs() -> list[tuple[str, list[str]]]:
    """A handful of 1-step runs covering every accepted value: all zeros together, all 10^12 together,
    the texts together (train.steps apart), then train.steps=0 and 10^12 on their own."""
    runs = [(value[:8] or "empty", [f"{f}={value}" for f in sorted(fields) if f != "train.steps"])
            for value, fields in ACCEPTED.items()]
    return runs + [("steps=0", ["train.steps=0"]), ("steps=1e12", ["train.steps=1000000000000"])]


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides", _accepted_runs(), ids=[n for n, _ in _accepted_runs()])
def test_accepted_values_run_one_step(preset, tmp_path, name, overrides):
    folders = {"output_dir": tmp_path / "run", "checkpoint.dir": tmp_path / "run" / "checkpoints"}
    for ov in overrides:  # a non-ASCII folder, inside this test's own
        key, value = ov.split("=", 1)
        if key in folders:
            folders[key] = tmp_path / f"{value}-{key}"
    overrides = [ov for ov in overrides if ov.split("=", 1)[0] not in folders]
    exp = load_config(preset, overrides + [f"{k}={v}" for k, v in folders.items()])
    if exp.train.steps == 0:
        assert loop.train(exp).step == 0
        assert sorted(p.name for p in (Path(exp.output_dir) / "final").iterdir()) == ["llama", "qwen3"]
        return
    run = loop.setup(exp)
    try:
        metrics = loop.train_step(run)
        assert run.step == 1
        assert all(math.isfinite(metrics[f"{n}/hacpo/loss"]) for n in ("llama", "qwen3")), metrics
        loop._save(run)
        assert (checkpoint_dir(exp) / "step-000001" / "COMPLETE").is_file()
    finally:
        run.verifier.close()
        for rt in run.runtimes:
            rt.close()


@pytest.mark.parametrize("override, line", [
    ("rollout.samples_per_prompt=1000000000", "rollout.samples_per_prompt=1000000000: must be <= 1024 (G responses "
                                              "per prompt are generated and held in memory at once"),
    ("agents.0.lr=.inf", "agents.0.lr=inf: must be a finite number in (0, 1] (an Adam update moves"),
    ("hacpo.alpha=.inf", "hacpo.alpha=inf: must be a finite number in [0, 100] (the exponent of the cross ratio"),
    ("agents.0.name=" + "a" * 300, f"agents.0.name={short_repr('a' * 300)}: is 300 characters long: at most 64"),
    ("train.adam_beta1=1.5", "train.adam_beta1=1.5: must be < 1 (Adam's decay of the first moment)"),
    ("data.difficulty=13", "data.difficulty=13: must lie in [1, 12] for the procedural task 'addition'"),
    ("log.every=0", "log.every=0: must be >= 1"),
])
def test_the_reported_values_are_refused_up_front(preset, capsys, override, line):
    assert main(["config", "--preset", preset, override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hacrl: configuration error: {line}"), err


def test_sequences_per_step_are_bounded(preset, capsys):
    assert main(["config", "--preset", preset, "train.prompts_per_step=2048", "rollout.samples_per_prompt=1024",
                 "train.mini_batches=1"]) == 2
    assert ("rollout.samples_per_prompt=1024: train.prompts_per_step × samples_per_prompt = 2097152 sequences per "
            "agent per step: at most 1048576") in capsys.readouterr().err
