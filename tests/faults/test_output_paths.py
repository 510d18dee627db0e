"""Output paths checked before any work, by one place (hacrl_megatron/outputs.py) for every command:
a path through a file, a read-only or full filesystem, ``metrics.jsonl`` made a folder. Each ends
with one line naming the path and the problem, exit 2, before a model is built."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest

from hacrl_megatron.cli import main
from hacrl_megatron.trainer import loop
from tests.faults.trainer_helpers import preset_file, tiny


@pytest.fixture
def mount(tmp_path):
    """``mount(options)`` → a fresh tmpfs with those mount options (skipped without mount rights)."""
    mounted = []

    def make(options: str) -> Path:
        where = tmp_path / f"mnt{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root and mount permission): {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(folder: Path) -> None:
    with open(folder / "ballast", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as err:
            assert err.errno == errno.ENOSPC
    for size in (4096, 1):
        try:
            with open(folder / f"ballast-{size}", "wb", buffering=0) as f:
                while True:
                    f.write(b"\0" * size)
        except OSError:
            pass


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the run gets as far as building anything."""
    def setup(exp):
        raise AssertionError("the run started working before its paths were checked")

    monkeypatch.setattr(loop, "setup", setup)


def _line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("hacrl")]
    assert len(lines) == 1, err
    return lines[0]


def test_output_dir_through_a_file(tmp_path, capsys, no_work):
    (tmp_path / "notes.txt").write_text("a file")
    preset = preset_file(tmp_path, tiny(tmp_path))
    run = tmp_path / "notes.txt" / "run"
    assert main(["train", "--preset", preset, f"output_dir={run}"]) == 2
    assert _line(capsys) == f"hacrl: output_dir {run}: {tmp_path / 'notes.txt'} is a file, not a folder"


def test_output_dir_on_a_read_only_filesystem(tmp_path, capsys, mount, no_work):
    read_only = mount("ro,size=1m")
    preset = preset_file(tmp_path, tiny(tmp_path))
    assert main(["train", "--preset", preset, f"output_dir={read_only / 'run'}"]) == 2
    assert _line(capsys) == f"hacrl: output_dir {read_only / 'run'}: {read_only} is on a read-only filesystem"


def test_cache_through_a_file_and_on_a_full_filesystem(tmp_path, capsys, mount, monkeypatch, no_work):
    preset = preset_file(tmp_path, tiny(tmp_path))  # char and pair tokenizers: built into the cache
    (tmp_path / "cachefile").write_text("")
    monkeypatch.setenv("HACRL_CACHE", str(tmp_path / "cachefile" / "c"))
    assert main(["train", "--preset", preset]) == 2
    assert _line(capsys) == (f"hacrl: the cache ($HACRL_CACHE) {tmp_path / 'cachefile' / 'c'}: "
                             f"{tmp_path / 'cachefile'} is a file, not a folder")
    full = mount("size=1m")
    _fill(full)
    monkeypatch.setenv("HACRL_CACHE", str(full / "cache"))
    assert main(["train", "--preset", preset]) == 2
    assert _line(capsys) == f"hacrl: the cache ($HACRL_CACHE) {full / 'cache'}: no space left on the filesystem of {full}"
    assert main(["pretrain", "--preset", preset]) == 2
    assert "no space left on the filesystem of" in _line(capsys)


def test_metrics_file_made_a_folder_is_named_on_resume_before_models_are_built(tmp_path, capsys, no_work):
    exp = tiny(tmp_path)
    (Path(exp.output_dir) / "metrics.jsonl").mkdir(parents=True)
    assert main(["train", "--preset", preset_file(tmp_path, exp), "checkpoint.resume=true"]) == 2
    metrics = Path(exp.output_dir).absolute() / "metrics.jsonl"
    assert _line(capsys) == f"hacrl: output_dir's metrics file {metrics}: is a folder, not a file"


def test_other_commands_check_their_outputs_first(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "out"
    assert main(["convert", "--from-hf", str(tmp_path / "no_model"), "--to-hf", str(target)]) == 2
    assert _line(capsys) == f"hacrl convert: --to-hf {target}: {tmp_path / 'file'} is a file, not a folder"
    assert main(["prepare", "data", "gsm8k", "--out", str(target)]) == 2  # before the hub is asked
    assert _line(capsys) == f"hacrl prepare: --out {target}: {tmp_path / 'file'} is a file, not a folder"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text('{"role": "output", "run_id": "x", "config": {}}')
    assert main(["convert", "--from-hf", str(tmp_path / "no_model"), "--to-megatron", str(tmp_path / "run")]) == 2
    assert f"--to-megatron {tmp_path / 'run'}: is the output folder of a run" in _line(capsys)
