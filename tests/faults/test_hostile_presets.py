"""Hostile presets and overrides: each is refused before anything is built, exit 2, one line naming the
file or the override, in bounded time and memory (config/bounded_yaml.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hacrl_megatron.cli import main

pytestmark = pytest.mark.timeout(120)  # a FIFO or /dev/zero read to the end would hang: fail instead


def _refused(capsys, args: list[str]) -> str:
    assert main(["config", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hacrl: configuration error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    # the value is quoted short, never expanded; paths are quoted whole, so the temporary folder does not count
    assert len(err.replace(str(Path(tempfile.gettempdir())), "<tmp>")) < 600, err
    return err


def _alias_bomb(levels: int = 9) -> str:
    """~400 bytes that expand to 9**9 (387 million) values once walked."""
    lines = ["a0: &a0 [x,x,x,x,x,x,x,x,x]"]
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nname: *a{levels - 1}\n"


def test_an_alias_bomb_is_refused_in_bounded_time_and_memory(tmp_path):
    preset = tmp_path / "bomb.yaml"
    preset.write_text(_alias_bomb())
    assert len(preset.read_bytes()) < 500
    # the CLI runs under a fresh wrapper process whose RUSAGE_CHILDREN is that CLI alone (this test
    # process's own RUSAGE_CHILDREN is the largest of every child the session ever waited for, a gloo
    # rank of an earlier test included)
    rss_file = tmp_path / "peak_kib"
    wrapper = ("import resource, subprocess, sys\n"
               "code = subprocess.run(sys.argv[2:]).returncode\n"
               "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
               "sys.exit(code)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", wrapper, str(rss_file), sys.executable, "-m", "hacrl_megatron",
                           "config", "--preset", str(preset)], capture_output=True, text=True, timeout=60)
    seconds, peak_mb = time.monotonic() - start, int(rss_file.read_text()) / 1024
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"hacrl: configuration error: preset file {preset}: expands to more than 20000 values "
                           "at line 5, column 18 (a preset holds a few hundred; an alias counts once per use)\n")
    assert seconds <= 10 + 30  # the bound is 10 s; 30 s more for Python's and torch's imports on a busy machine
    assert peak_mb <= 500, peak_mb


def test_an_alias_bomb_in_an_override_is_refused(capsys):
    value = "[" + ",".join(["[" + ",".join(["x"] * 200) + "]"] * 200) + "]"  # 40,000 values, no alias
    err = _refused(capsys, [f"name={value}"])
    assert "override 'name=[[" in err and "expands to more than 20000 values" in err


@pytest.mark.parametrize("make, expected", [
    (lambda p: p.write_text("name: " + "[" * 100_000 + "]" * 100_000 + "\n"), "nested more than 32 levels deep"),
    (lambda p: p.write_text("train:\n  steps: " + "9" * 5000 + "\n"),
     "a value cannot be read (Exceeds the limit (4300 digits) for integer string conversion"),
    (lambda p: p.write_text("".join(f"k{i}: {i}\n" for i in range(600_000))),
     "9377780 bytes, more than a preset may hold (262144 bytes)"),
    (lambda p: p.write_bytes(b"name: caf\xe9\n"), "not UTF-8 text (byte 9: invalid continuation byte)"),
    (lambda p: p.mkdir(), "is a folder, not a YAML file"),
    (lambda p: os.mkfifo(p), "not a regular file (a FIFO, socket or device cannot be a preset)"),
    (lambda p: p.write_text("base: 3\nname: x\n"), "base: must be a preset name or a YAML path, got 3"),
    (lambda p: p.write_text("base: [cpu_demo]\n"), "base: must be a preset name or a YAML path, got ['cpu_demo']"),
], ids=["deep nesting", "giant int", "5 MB", "not UTF-8", "folder", "FIFO", "int base", "list base"])
def test_a_hostile_preset_file_is_named(tmp_path, capsys, make, expected):
    preset = tmp_path / "hostile.yaml"
    make(preset)
    start = time.monotonic()
    err = _refused(capsys, ["--preset", str(preset)])
    assert f"preset file {preset}: {expected}" in err
    assert time.monotonic() - start < 10


def test_dev_zero_as_a_preset_is_refused_unread(capsys):
    assert "preset file /dev/zero: not a regular file" in _refused(capsys, ["--preset", "/dev/zero"])


def test_a_base_cycle_is_named(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("base: b.yaml\nname: a\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nname: b\n")
    err = _refused(capsys, ["--preset", str(tmp_path / "a.yaml")])
    assert (f"preset file {tmp_path / 'a.yaml'}: base: chain returns to a preset it already read "
            f"({tmp_path / 'a.yaml'} -> {tmp_path / 'b.yaml'} -> {tmp_path / 'a.yaml'})") in err
    (tmp_path / "self.yaml").write_text("base: self.yaml\n")
    assert "base: chain returns to a preset it already read" in _refused(capsys, ["--preset", str(tmp_path / "self.yaml")])


def test_base_is_resolved_beside_the_preset_that_names_it(tmp_path, capsys, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "child.yaml").write_text("base: parent.yaml\nname: child\n")
    (tmp_path / "sub" / "parent.yaml").write_text("base: cpu_demo\ntrain: {steps: 7}\n")
    monkeypatch.chdir(tmp_path)  # not the preset's folder: the base is still found beside its child
    assert main(["config", "--preset", "sub/child.yaml"]) == 0
    out = capsys.readouterr().out
    assert "name: child\n" in out and "  steps: 7\n" in out


@pytest.mark.parametrize("override, expected", [
    (".".join(["a"] * 5000) + "=1", "the key has 5000 parts, more than any config field (32)"),
    ("train.steps=" + "[" * 5000, "nested more than 32 levels deep at line 1, column 33"),
    ("train.steps=" + "9" * 5000, "a value cannot be read (Exceeds the limit (4300 digits)"),
    ("name=" + "x" * 100_000, "name='xxxxxxxx"),
], ids=["5000-deep key", "5000-deep value", "giant int", "long string"])
def test_a_hostile_override_is_named(capsys, override, expected):
    assert expected in _refused(capsys, [override])


def test_keys_that_are_not_text_are_named(tmp_path, capsys):
    preset = tmp_path / "keys.yaml"
    preset.write_text("1: 2\nnull: 3\nname: x\n")
    assert "ExperimentConfig: unknown key(s) [1, None]; allowed: " in _refused(capsys, ["--preset", str(preset)])
