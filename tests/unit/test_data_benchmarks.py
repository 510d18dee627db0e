"""Benchmark loaders on fixture files written in each dataset's exact schema; dataset tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hacrl_megatron.data import BENCHMARKS, PromptRecord, load_benchmark, make_task
from hacrl_megatron.data.benchmarks import DataFileError, resolve_data_files
from hacrl_megatron.reward import RewardRequest, score_request

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"

EXPECTED = {
    "math": [
        ("math-train-0", "\\frac{1}{2}"),
        ("math-train-1", "4"),
        ("math-train-2", "6"),  # last box is an \fbox
        ("math-train-3", "5\\sqrt{2}"),
    ],
    "math500": [
        ("math500-test/algebra/101.json", "81"),
        ("math500-test/precalculus/807.json", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("math500-test/prealgebra/12.json", "5"),
    ],
    "gsm8k": [("gsm8k-test-0", "7"), ("gsm8k-test-1", "1000"), ("gsm8k-test-2", "60")],
    "aime2025": [("aime2025-I-1", "24"), ("aime2025-I-2", "9"), ("aime2025-II-1", "1")],
    "amc23": [("amc23-0", "55"), ("amc23-1", "6"), ("amc23-2", "7")],
    "minerva": [("minerva-test-0", "60"), ("minerva-test-1", "2"), ("minerva-test-2", "0.125")],
    "olympiadbench": [
        ("olympiadbench-1606", "8"),
        ("olympiadbench-1607", "-2, 2"),
        ("olympiadbench-1608", "9"),
    ],
    "custom": [("custom-s-1", "400+57"), ("custom-s-2", "12"), ("custom-train-2", "2, 3")],  # a user's own file
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("HACRL_DATA_DIR", raising=False)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_each_loader_normalises_its_schema(name):
    records = load_benchmark(name, str(FIXTURES / name))
    assert [(r.id, r.answer) for r in records] == EXPECTED[name]
    assert all(isinstance(r, PromptRecord) and r.kind == "math" and r.source == name for r in records)
    assert all(r.question.strip() for r in records)


def test_question_fields_and_context():
    gsm = load_benchmark("gsm8k", str(FIXTURES / "gsm8k"))
    assert gsm[0].question.startswith("Tom has 3 apples")
    olymp = load_benchmark("olympiadbench", str(FIXTURES / "olympiadbench"))
    assert olymp[2].question == "A square has side length 3.\n\nFind its area."


def test_data_dir_env_and_limit(monkeypatch):
    monkeypatch.setenv("HACRL_DATA_DIR", str(FIXTURES))
    assert [r.answer for r in load_benchmark("math500", limit=2)] == [
        "81",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
    ]
    files = resolve_data_files("gsm8k")
    assert files == [FIXTURES / "gsm8k" / "test-00000-of-00001.parquet"]
    assert load_benchmark("aime2025", limit=0) == []


def test_single_file_path_and_column_variants(tmp_path):
    # math-ai/minervamath style (question/answer) and a file path instead of a directory
    f = tmp_path / "minerva.jsonl"
    f.write_text(json.dumps({"question": "Compute 2+2.", "answer": "4"}) + "\n")
    (rec,) = load_benchmark("minerva", str(f))
    assert (rec.question, rec.answer) == ("Compute 2+2.", "4")


def test_rows_without_answer_are_skipped(tmp_path, caplog):
    f = tmp_path / "train.jsonl"
    rows = [
        {"problem": "p1", "level": "Level 1", "type": "Algebra", "solution": "so \\boxed{3}"},
        {"problem": "p2", "level": "Level 1", "type": "Algebra", "solution": "no box at all"},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_benchmark("math", str(f))
    assert [r.answer for r in records] == ["3"]
    assert f"math: skipped 1 of 2 rows without a question or a reference answer: {f}:2" in caplog.text


def test_missing_file_errors_say_where_to_put_it(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"HACRL_DATA_DIR=<dir> with <dir>/math500/test.jsonl"):
        load_benchmark("math500")
    monkeypatch.setenv("HACRL_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "aime2025" / "test.jsonl")):
        load_benchmark("aime2025")
    with pytest.raises(FileNotFoundError, match="Nothing is downloaded"):
        load_benchmark("gsm8k", str(tmp_path / "nowhere"))


def test_unknown_name_and_bad_columns(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark 'mmlu'; valid names: math, math500, gsm8k"):
        load_benchmark("mmlu", str(tmp_path))
    f = tmp_path / "test.jsonl"
    f.write_text(json.dumps({"prompt": "x", "answer": "1"}) + "\n")
    with pytest.raises(
        DataFileError, match=r"test.jsonl:1: aime2025 row has no value in column problem or question "
        r"\(missing or null\); its columns are \['answer', 'prompt'\]"
    ):
        load_benchmark("aime2025", str(f))
    with pytest.raises(ValueError, match="limit=-1"):
        load_benchmark("aime2025", str(f), limit=-1)


def test_dataset_task_sampling_eval_and_sft():
    task = make_task("math", seed=7, path=str(FIXTURES / "math"), eval_holdout=1)
    again = make_task("math", seed=7, path=str(FIXTURES / "math"), eval_holdout=1)
    (held_out,) = task.eval_set(1)
    train = task.sample(9)
    assert train == again.sample(9)
    assert task.sample(4, offset=5) == train[5:]
    assert held_out not in train
    assert {r.id for r in train[:3]} == {r.id for r in train[3:6]}  # 3 train items, each epoch a permutation
    for rec in train[:3] + [held_out]:
        target = task.sft_target(rec)
        assert target.rstrip(" .$").endswith("}")
        assert score_request(RewardRequest(rec.kind, target, rec.answer)) == 1.0
    with pytest.raises(ValueError, match="exceeds the 1 held-out items"):
        task.eval_set(2)
    with pytest.raises(DataFileError, match="is a test split; a dataset task trains on its train split"):
        make_task("gsm8k", path=str(FIXTURES / "gsm8k"), eval_holdout=0)  # the fixture holds the test split only
    gsm = make_task("gsm8k", path=str(FIXTURES / "gsm8k"), eval_holdout=0, allow_test_split=True)
    rec = gsm.sample(1)[0]
    assert gsm.sft_target(rec).endswith(f"The final answer is \\boxed{{{rec.answer}}}.")
    assert "####" not in gsm.sft_target(rec)
