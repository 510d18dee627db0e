"""The `hacrl` entry point: commands that exist, and bad input rejected before any work."""

import subprocess
import sys

from hacrl_megatron.cli import build_parser, main


def test_help_lists_only_working_commands():
    names = set(build_parser()._subparsers._group_actions[0].choices)
    assert {"train", "pretrain", "config", "presets", "eval", "convert", "launch"} <= names


def test_bad_override_exits_2_with_named_field(capsys):
    assert main(["train", "hacpo.alpha=-2"]) == 2
    err = capsys.readouterr().err
    assert "hacpo.alpha=-2.0" in err and "must be >= 0" in err


def test_unknown_preset_exits_2(capsys):
    assert main(["config", "--preset", "nope"]) == 2
    assert "built-in presets" in capsys.readouterr().err


def test_config_prints_resolved_yaml(capsys):
    assert main(["config", "hacpo.alpha=3"]) == 0
    assert "alpha: 3.0" in capsys.readouterr().out


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "hacrl_megatron", "presets"], capture_output=True, text=True, check=True)
    assert "cpu_demo" in out.stdout
