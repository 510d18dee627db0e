"""data.eval_benchmarks during training: avg@k / pass@k per agent and benchmark every train.eval_every
steps (and at step 0), in metrics.jsonl, in the final table; names and files refused at `hacrl config`."""

from __future__ import annotations

import json

import pytest

from hacrl_megatron.cli import main
from hacrl_megatron.config import ConfigError, load_config
from hacrl_megatron.data.eval_sets import EVAL_SPLITS, load_eval_benchmarks
from hacrl_megatron.trainer import loop
from hacrl_megatron.trainer.evaluation import accuracy_table
from hacrl_megatron.trainer.metrics import read_metrics
from tests.e2e.test_trainer import tiny_exp
from tests.faults.trainer_helpers import exp_with

MATH500_ROWS = [{"problem": f"What is {a} + {b}?", "answer": str(a + b), "unique_id": f"t/{a}{b}"}
                for a, b in ((1, 2), (3, 4), (5, 6))]


def _math500_file(tmp_path):
    path = tmp_path / "math500.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MATH500_ROWS))
    return path


def test_benchmarks_are_evaluated_every_eval_step_and_shown_in_the_final_table(tmp_path, capsys, caplog):
    caplog.set_level("INFO", logger="hacrl_megatron")
    exp = tiny_exp(tmp_path, steps=2)
    exp = exp_with(exp, train={"eval_every": 1, "eval_samples": 2, "eval_temperature": 1.0},
                   data={"eval_benchmarks": ["addition", "math500"], "eval_limit": 3,
                         "benchmark_paths": {"math500": str(_math500_file(tmp_path))}})
    run = loop.train(exp)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:  # before training and after each step
        for agent in ("llama", "qwen3"):
            for bench in ("addition", "math500"):
                avg, best = row[f"{agent}/eval/{bench}/avg@2"], row[f"{agent}/eval/{bench}/pass@2"]
                assert 0.0 <= avg <= best <= 1.0  # pass@2 ≥ avg@2: one of two correct counts for pass
                assert avg * 6 == pytest.approx(round(avg * 6))  # 3 problems × 2 samples
        assert "llama/eval_accuracy" not in row  # data.eval_size = 0: no held-out set
    assert list(run.history) == [f"{a}/eval/{b}/avg@2" for a in ("llama", "qwen3") for b in ("addition", "math500")]
    out = capsys.readouterr().out
    assert "| llama: addition avg@2 |" in out and "| qwen3: math500 avg@2 |" in out
    assert out.count("step 1: eval llama: addition avg@2=") == 1 and "; qwen3: addition avg@2=" in out
    assert " on addition: " not in caplog.text  # printed once per evaluation: not logged a second time


def test_procedural_set_and_benchmarks_side_by_side(tmp_path):
    exp = exp_with(tiny_exp(tmp_path, steps=1), train={"eval_every": 1},
                   data={"eval_size": 4, "eval_benchmarks": ["arithmetic"], "eval_limit": 2})
    run = loop.train(exp)
    row = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert {"llama/eval_accuracy", "qwen3/eval_accuracy", "llama/eval/arithmetic/avg@1",
            "qwen3/eval/arithmetic/pass@1"} <= set(row)
    assert row["llama/eval/arithmetic/avg@1"] == row["llama/eval/arithmetic/pass@1"]  # greedy, k = 1
    table = accuracy_table(run.history, exp)
    assert table.splitlines()[2].startswith("| llama | ") and "| qwen3: arithmetic avg@1 |" in table


def test_benchmark_files_are_read_from_the_prepared_folder_or_the_map(tmp_path, monkeypatch):
    monkeypatch.delenv("HACRL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "math500").mkdir(parents=True)
    (tmp_path / "data" / "math500" / f"{EVAL_SPLITS['math500']}.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in MATH500_ROWS))
    got = load_eval_benchmarks(["math500", "addition"], {}, 2, 1, 7)
    assert [r.answer for r in got["math500"]] == ["3", "7"] and len(got["addition"]) == 2
    other = _math500_file(tmp_path / "data")
    assert len(load_eval_benchmarks(["math500"], {"math500": str(other)}, 0, 1, 7)["math500"]) == 3


def _config_error(capsys, *overrides):
    assert main(["config", "--preset", "cpu_demo", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_unknown_or_missing_benchmarks_are_refused_at_hacrl_config(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HACRL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    err = _config_error(capsys, "data.eval_benchmarks=[addition, gsm8kk]")
    assert err.startswith("hacrl: configuration error: data.eval_benchmarks=") and "'gsm8kk' is not a benchmark" in err
    err = _config_error(capsys, "data.eval_benchmarks=[gsm8k]")
    assert "data.eval_benchmarks=['gsm8k']: benchmark 'gsm8k' reads data/gsm8k (no such file or folder)" in err
    assert "hacrl prepare data gsm8k" in err
    err = _config_error(capsys, "data.eval_benchmarks=[gsm8k]", f"data.benchmark_paths.gsm8k={tmp_path}")
    assert f"data.benchmark_paths.gsm8k='{tmp_path}'" in err and "no test.jsonl" in err
    err = _config_error(capsys, "data.benchmark_paths.addition=x.jsonl")
    assert "data.benchmark_paths.addition='x.jsonl': 'addition' is not a dataset benchmark" in err
    assert "listed twice" in _config_error(capsys, "data.eval_benchmarks=[addition, addition]")
    err = _config_error(capsys, "data.eval_benchmarks=[addition]", "train.eval_samples=4")
    assert "train.eval_samples=4: greedy evaluation (train.eval_temperature=0)" in err
    assert "data.benchmark_paths: expected a mapping (name: value), got a list" in _config_error(capsys, "data.benchmark_paths=[a]")
    assert main(["config", "--preset", "cpu_demo", "data.eval_benchmarks=[addition]", "train.eval_samples=4",
                 "train.eval_temperature=0.7"]) == 0


@pytest.mark.parametrize("preset", ["paper_qwen3_4b_with_instruct", "paper_qwen3_1p7b_with_4b_base",
                                    "paper_qwen3_4b_base_with_llama3p2_3b"])
def test_paper_presets_evaluate_on_their_seven_benchmarks(preset):
    cfg = load_config(preset)
    assert cfg.data.eval_benchmarks == ["math500", "math", "gsm8k", "aime2025", "amc23", "minerva", "olympiadbench"]
    assert cfg.train.eval_every > 0 and loop._evaluates(cfg, cfg.train.eval_every) and loop._evaluates(cfg, 0)
    with pytest.raises(ConfigError, match="data.eval_benchmarks="):
        load_config(preset, ["data.eval_benchmarks=[math501]"])
