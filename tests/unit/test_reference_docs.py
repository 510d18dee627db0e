"""docs/reference.md is what hacrl_megatron/reference_docs.py writes from the code, documents every
configuration key, and names every metric a run logs; `hacrl --version`."""

from __future__ import annotations

import re

import pytest

from hacrl_megatron import __version__
from hacrl_megatron.cli import main
from hacrl_megatron.config.ranges import flat_fields
from hacrl_megatron.config.schema import ExperimentConfig
from hacrl_megatron.metric_names import METRICS, describe
from hacrl_megatron.reference_docs import KEY_MAP, PAGE, config_rows, render
from hacrl_megatron.trainer import loop
from hacrl_megatron.trainer.metrics import read_metrics
from tests.e2e.test_trainer import tiny_exp
from tests.faults.trainer_helpers import exp_with


def test_the_page_is_current():
    assert PAGE.read_text(encoding="utf-8") == render(), (
        "docs/reference.md is not current: run python -m hacrl_megatron.reference_docs --write")


def test_every_configuration_key_has_a_type_default_and_meaning():
    rows = {row[0]: row for row in config_rows()}
    keys = {k.replace("agents.0.", "agents.N.") for k in flat_fields(ExperimentConfig()) if not k.startswith("agents.1")}
    keys = {re.sub(r"\.\d+$", "", k) for k in keys}  # list items (rollout_gpu_ids.0) are the list's key
    missing = sorted(k for k in keys if k not in rows)
    assert not missing, f"keys missing from docs/reference.md: {missing}"
    undocumented = sorted(k for k, row in rows.items() if not row[4].strip())
    assert not undocumented, ("keys without a meaning: comment them in config/schema.py (or add them to "
                              f"reference_docs.MEANINGS): {undocumented}")


def test_the_framework_map_names_only_keys_we_have():
    ours = {row[0] for row in config_rows()}
    for row in KEY_MAP:
        for key in re.findall(r"\b(?:agents\.N|rollout|train|data|hacpo|checkpoint|log)\.[a-z_.]+[a-z_]", row[3]):
            assert key in ours, f"KEY_MAP names {key!r}, which is not a configuration key"


@pytest.mark.parametrize("variant", [
    # a task with problem families: the per-family metrics (docs/algorithm.md §10b)
    {"hacpo": {"kl_coef": 1e-3, "cross_window": "adaptive", "log_cross_grad_share": True},
     "train": {"rollout_mode": "one_step_off"}, "data": {"task": "add_sub_cot"}},
    {"hacpo": {"algorithm": "grpo"}},
])
def test_every_metric_a_run_logs_is_documented(tmp_path, variant):
    train = {"eval_every": 1, **variant.pop("train", {})}
    data = {"eval_size": 4, "eval_benchmarks": ["addition"], "eval_limit": 2, **variant.pop("data", {})}
    exp = exp_with(tiny_exp(tmp_path, steps=2), train=train, data=data, **variant)
    loop.train(exp)
    keys = {k for row in read_metrics(tmp_path / "run" / "metrics.jsonl") for k in row}
    undocumented = sorted(k for k in keys if describe(k, ["llama", "qwen3"]) is None)
    assert not undocumented, f"metrics missing from metric_names.METRICS (docs/reference.md): {undocumented}"
    assert len(keys) > 40
    if data.get("task") == "add_sub_cot":
        for agent, source in (("llama", "qwen3"), ("qwen3", "llama")):
            assert {f"{agent}/reward/add/mean", f"{agent}/reward/sub/mean", f"{agent}/hacpo/family/add/cross_grad_share",
                    f"{agent}/hacpo/family/sub/cross_log_ratio_median/{source}"} <= keys


def test_metric_patterns_are_unique_and_described():
    names = [m[0] for m in METRICS]
    assert len(names) == len(set(names)) and all(unit and meaning for _, unit, meaning in METRICS)


def test_hacrl_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"hacrl {__version__}"
