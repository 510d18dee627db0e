"""A user's own dataset (``data.task=custom``) that would train on the wrong prompts or crash the loader:
each is refused by `hacrl config` and by `hacrl train` before any model is built, exit 2, one line
naming the file, the line and the column or id."""

from __future__ import annotations

import json

import pytest
import torch

from hacrl_megatron.cli import main
from hacrl_megatron.trainer import loop
from tests.faults.trainer_helpers import exp_with, tiny

torch.set_num_threads(1)


def _rows(n: int = 50) -> list[dict]:
    return [{"id": f"q{i}", "question": f"{i}+1=", "answer": str(i + 1)} for i in range(n)]


def _write(path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _refused(capsys, command: str, *args: str) -> str:
    assert main([command, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def no_build(monkeypatch):
    """`hacrl train` must refuse before any warm-up or model build."""
    def never(*args, **kwargs):
        raise AssertionError("warm-up or model build started before the data was checked")

    for name in ("apply_warmup", "build_runtime", "configure_process"):
        monkeypatch.setattr(loop, name, never)


CASES = {  # rows of the file, and the line `hacrl` must print (after the file's path)
    "duplicate id": ([*_rows(6)[:5], {"id": "q2", "question": "9+9=", "answer": "18"}],
                     ":6: id 'q2' is already used by {path}:3: ids must be unique"),
    "generated id collides": ([{"question": "1+1=", "answer": "2"}, {"id": "train-0", "question": "2+2=", "answer": "4"}],
                              ":2: id 'train-0' is already used by {path}:1: ids must be unique"),
    "list question": ([*_rows(2), {"id": "x", "question": ["a", "list"], "answer": "1"}],
                      ":3: column question: the question must be text, got list"),
    "mapping question": ([{"id": "x", "problem": {"k": 1}, "answer": "1"}],
                         ":1: column problem: the question must be text, got dict"),
    "NaN answer": ([*_rows(1), '{"id": "y", "question": "q", "answer": NaN}'],
                   ":2: column answer: the reference answer is nan (not a finite number)"),
    "infinite answer": (['{"id": "y", "question": "q", "answer": -Infinity}'],
                        ":1: column answer: the reference answer is -inf (not a finite number)"),
    "mapping answer": ([{"id": "y", "question": "q", "answer": {"k": 1}}],
                       ":1: column answer: the reference answer is a mapping"),
    "list id": ([{"id": [1], "question": "q", "answer": "1"}], ":1: column id: must be text or an integer, got list"),
    "solution not text": ([{"id": "y", "question": "q", "answer": "1", "solution": ["a"]}],
                          ":1: column solution: must be text, got list"),
    "giant integer": (['{"id": "y", "question": "q", "answer": ' + "9" * 5000 + "}"],
                      ":1: a value cannot be read (Exceeds the limit (4300 digits) for integer string conversion"),
    "deep nesting": (['{"id": "y", "question": "q", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}"],
                     ":1: nested too deeply to read"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_custom_dataset_is_refused_by_config_and_train(tmp_path, capsys, no_build, case):
    rows, expected = CASES[case]
    path = _write(tmp_path / "mine.jsonl", rows)
    line = path + expected.format(path=path)
    data = ["data.task=custom", f"data.path={path}", "data.eval_size=0"]
    assert line in _refused(capsys, "config", *data)
    out = tmp_path / "run"
    assert line in _refused(capsys, "train", *data, f"output_dir={out}", "log.tensorboard=false")
    assert not out.exists() or not any((out / "checkpoints").glob("*"))  # nothing written


def test_a_json_array_file_names_the_item_of_a_giant_integer(tmp_path, capsys):
    path = tmp_path / "mine.json"
    path.write_text('[{"id": "y", "question": "q", "answer": ' + "9" * 5000 + "}]")
    err = _refused(capsys, "config", "data.task=custom", f"data.path={path}", "data.eval_size=0")
    assert f"{path}: a value cannot be read" in err


def test_eval_size_beyond_the_held_out_rows_is_refused_alike_by_config_and_train(tmp_path, capsys, no_build):
    path = _write(tmp_path / "small.jsonl", _rows(50))
    line = (f"hacrl: data.eval_size=200: dataset 'custom' ({path}) has 50 usable rows, 5 of them held out for "
            "evaluation (a tenth, at most 200): set data.eval_size <= 5, or train.eval_every=0 to train without "
            "evaluation\n")
    data = ["data.task=custom", f"data.path={path}"]
    assert _refused(capsys, "config", *data) == line
    assert _refused(capsys, "train", *data, f"output_dir={tmp_path / 'run'}") == line
    for accepted in (["data.eval_size=5"], ["train.eval_every=0"], ["data.eval_size=0"]):
        assert main(["config", *data, *accepted]) == 0, capsys.readouterr().err


def test_training_without_evaluation_needs_no_held_out_rows(tmp_path):
    path = _write(tmp_path / "small.jsonl", _rows(50))
    exp = exp_with(tiny(tmp_path, steps=1), data={"task": "custom", "path": path, "eval_size": 200},
                   train={"eval_every": 0})
    run = loop.setup(exp)
    try:
        assert run.eval_records == [] and len(run.task.sample(8)) == 8
    finally:
        run.verifier.close()
        for rt in run.runtimes:
            rt.close()
