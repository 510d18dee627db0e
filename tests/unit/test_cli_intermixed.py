"""Every `hacrl` command takes its options and its positionals (``key=value`` overrides, names) in any
order: an override after an option is kept, not refused as an unrecognized argument."""

from __future__ import annotations

import pytest

from hacrl_megatron.cli import build_parser, main


def _parsed(*argv: str) -> dict:
    return {k: v for k, v in vars(build_parser().parse_args(list(argv))).items() if k != "func"}


@pytest.mark.parametrize("command", ["train", "pretrain", "config"])
def test_overrides_before_between_and_after_options(command):
    extra = {"train": ["--agent", "llama"], "pretrain": ["--force"], "config": []}[command]
    args = _parsed(command, "a=1", "--preset", "cpu_demo", "b=2", *extra, "c=3")
    assert args["overrides"] == ["a=1", "b=2", "c=3"] and args["preset"] == "cpu_demo"


def test_train_agent_then_output_dir_as_a_user_types_it():
    args = _parsed("train", "--preset", "cpu_demo", "--agent", "llama", "output_dir=X")
    assert args["agent"] == "llama" and args["overrides"] == ["output_dir=X"]
    args = _parsed("train", "x=1", "--new", "y=2")
    assert args["new"] is True and args["overrides"] == ["x=1", "y=2"]


def test_config_applies_an_override_given_after_the_preset_option(capsys):
    assert main(["config", "hacpo.alpha=3", "--preset", "cpu_demo", "train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "alpha: 3.0" in out and "steps: 7" in out


def test_launch_overrides_around_name():
    args = _parsed("launch", "a=b", "--name", "N", "c=d", "--dryrun")
    assert args["name"] == "N" and args["overrides"] == ["a=b", "c=d"] and args["dryrun"] is True


def test_plan_overrides_around_options():
    args = _parsed("plan", "--preset", "cpu_demo", "a=b", "--nodes", "2", "c=d", "--gpu-memory-gib", "80")
    assert args["overrides"] == ["a=b", "c=d"] and args["nodes"] == 2 and args["gpu_memory_gib"] == 80


def test_prepare_names_around_options():
    args = _parsed("prepare", "data", "gsm8k", "--out", "o", "math")
    assert args["names"] == ["gsm8k", "math"] and args["out"] == "o"


def test_samples_run_folder_after_options():
    args = _parsed("samples", "--step", "3", "runs/x", "--agent", "llama")
    assert args["run"] == "runs/x" and args["step"] == 3 and args["agent"] == "llama"


def test_eval_options_in_any_order():
    args = _parsed("eval", "--benchmarks", "addition", "--agent", "a", "--agent", "b")
    assert args["agent"] == ["a", "b"] and args["benchmarks"] == ["addition"]


def test_an_unknown_option_is_still_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["train", "a=b", "--agnt", "llama"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --agnt" in capsys.readouterr().err
