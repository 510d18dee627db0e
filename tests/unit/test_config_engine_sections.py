"""Engine settings in their own sections (``rollout.hf``, ``rollout.sglang``) and the old flat keys
(``rollout.sglang_tp``, ...) as validated aliases for one release: each maps to its new field with a
FutureWarning naming both keys, and an old key given with a different value than its new key is an
error naming both. ``hacrl config`` prints the sections."""

from __future__ import annotations

import warnings

import pytest
import yaml

from hacrl_megatron.cli import main
from hacrl_megatron.config import (
    SGLANG_PYTHON_ENV,
    ConfigError,
    ExperimentConfig,
    RolloutConfig,
    SGLangConfig,
    from_dict,
    load_config,
)
from hacrl_megatron.config.loading import resolve_key_aliases

OLD_AND_NEW = [
    ("rollout.sglang_tp=2", "tp", 2),
    ("rollout.sglang_mem_fraction=0.4", "mem_fraction", 0.4),
    ("rollout.sglang_args=[--log-level,debug]", "args", ["--log-level", "debug"]),
    ("rollout.sglang_command=[srun,python]", "command", ["srun", "python"]),
    ("rollout.sglang_python=/opt/sglang/bin/python", "python", "/opt/sglang/bin/python"),
]


@pytest.mark.parametrize("override, field, value", OLD_AND_NEW)
def test_each_old_key_maps_to_its_new_field_with_a_warning_naming_both(override, field, value):
    old = override.split("=")[0]
    with pytest.warns(FutureWarning, match=rf"config key {old} is deprecated: use rollout\.sglang\.{field} "):
        cfg = load_config("cpu_demo", [override])
    assert getattr(cfg.rollout.sglang, field) == value
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new key alone: no warning
        new = load_config("cpu_demo", [f"rollout.sglang.{field}={override.split('=', 1)[1]}"])
    assert new.rollout.sglang == cfg.rollout.sglang


def test_an_old_key_is_validated_under_its_new_name():
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match=r"rollout\.sglang\.tp=0: must be >= 1"):
        load_config("cpu_demo", ["rollout.sglang_tp=0"])
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match=r"rollout\.sglang\.tp: expected an integer"):
        load_config("cpu_demo", ["rollout.sglang_tp=two"])


def test_old_and_new_key_with_different_values_is_an_error_naming_both():
    with pytest.raises(ConfigError, match=r"rollout\.sglang_tp=2 and rollout\.sglang\.tp=4 are both given: "
                                          r"rollout\.sglang_tp is the old name of rollout\.sglang\.tp; give only "
                                          r"rollout\.sglang\.tp"):
        load_config("cpu_demo", ["rollout.sglang.tp=4", "rollout.sglang_tp=2"])
    with pytest.warns(FutureWarning):  # the same value twice is not a conflict
        assert load_config("cpu_demo", ["rollout.sglang.tp=2", "rollout.sglang_tp=2"]).rollout.sglang.tp == 2


def test_aliases_in_a_preset_file_and_the_callers_dict_left_untouched(tmp_path):
    preset = tmp_path / "old.yaml"
    preset.write_text("base: cpu_demo\nrollout:\n  sglang_tp: 2\n  sglang_mem_fraction: 0.5\n  sglang:\n    args: [--x]\n")
    with pytest.warns(FutureWarning):
        s = load_config(str(preset)).rollout.sglang
    assert (s.tp, s.mem_fraction, s.args) == (2, 0.5, ["--x"])
    data = {"sglang_tp": 2, "sglang": {"python": "/p"}}
    with pytest.warns(FutureWarning):
        out = resolve_key_aliases(RolloutConfig, data, "rollout")
    assert out == {"sglang": {"python": "/p", "tp": 2}} and data == {"sglang_tp": 2, "sglang": {"python": "/p"}}
    with pytest.raises(ConfigError, match=r"rollout\.sglang: expected a mapping to hold rollout\.sglang_tp, got 3"):
        resolve_key_aliases(RolloutConfig, {"sglang_tp": 2, "sglang": 3}, "rollout")
    with pytest.raises(ConfigError, match=r"rollout\.sglang: expected a mapping to hold rollout\.sglang_tp, got SGLang"):
        from_dict(RolloutConfig, {"sglang_tp": 2, "sglang": SGLangConfig(python="/p")}, "rollout")


def test_unknown_keys_in_a_section_name_the_section():
    with pytest.raises(ConfigError, match=r"rollout\.sglang: unknown key\(s\) \['tp_size'\]"):
        load_config("cpu_demo", ["rollout.sglang.tp_size=2"])
    with pytest.raises(ConfigError, match=r"rollout\.hf\.max_batch_size=0: must be >= 1"):
        load_config("cpu_demo", ["rollout.hf.max_batch_size=0"])


def test_hacrl_config_prints_the_engine_sections(capsys, monkeypatch):
    monkeypatch.delenv(SGLANG_PYTHON_ENV, raising=False)
    assert main(["config", "--preset", "cpu_demo", "rollout.engine=sglang", "rollout.sglang.tp=2"]) == 0
    rollout = yaml.safe_load(capsys.readouterr().out)["rollout"]
    assert rollout["sglang"] == {"tp": 2, "mem_fraction": 0.7, "args": [], "command": [], "python": "",
                                 "placement": "local", "host": "", "api_key_file": "", "cpu": False}
    assert rollout["hf"] == {"max_batch_size": 64}
    assert not [k for k in rollout if k.startswith("sglang_")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shipped presets use the new keys
        paper = load_config("paper_qwen3_4b_with_instruct").rollout.sglang
    assert (paper.tp, paper.mem_fraction) == (2, 0.5)
    assert "sglang" in ExperimentConfig().to_dict()["rollout"]
