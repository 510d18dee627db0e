"""benchmarks/diagnose_cross_ratios.py's Table 6 comparison: the distribution of s per learner and the
logged cross_ratio_mean of finished runs (pure functions on made-up rows; the sampling part runs the
trainer's own stages and is exercised by the script itself)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("diagnose_cross_ratios", ROOT / "benchmarks" / "diagnose_cross_ratios.py")
diag = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(diag)


def test_distribution_per_learner():
    values = [0.70, 0.80, 0.85, 0.90, 1.00, 1.10]
    rows = [{"learner": "weak", "source": "strong", "correct": True, "log_s_token": math.log(v)} for v in values]
    rows.append({"learner": "strong", "source": "weak", "correct": False, "log_s_token": math.log(0.9)})
    out = diag.distribution(rows, low=0.8)
    weak = out["weak"]
    assert weak["n"] == 6 and weak["mean"] == pytest.approx(sum(values) / 6)
    assert weak["frac_in_window"] == pytest.approx(4 / 6)  # 0.80, 0.85, 0.90, 1.00: both ends included
    assert weak["q50"] == pytest.approx(0.875) and weak["q05"] == pytest.approx(0.725)
    assert out["strong"] == {"n": 1, "mean": pytest.approx(0.9), "frac_in_window": 1.0,
                             **{k: pytest.approx(0.9) for k in ("q05", "q25", "q50", "q75", "q95")}}


def test_band_distance_is_zero_inside_the_widened_table6_range():
    assert diag.band_distance(0.896) == 0.0
    assert diag.band_distance(0.812) == pytest.approx(0.0) and diag.band_distance(0.986) == pytest.approx(0.0)
    assert diag.band_distance(0.80) == pytest.approx(0.012)
    assert diag.band_distance(1.0) == pytest.approx(0.014)


def write_run(folder: Path, series: dict[str, list[float]]) -> Path:
    folder.mkdir()
    steps = len(next(iter(series.values())))
    rows = [{"step": s + 1, **{f"{a}/hacpo/cross_ratio_mean": v[s] for a, v in series.items()}} for s in range(steps)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_training_ratios_over_runs(tmp_path):
    a = write_run(tmp_path / "a", {"weak": [0.9, 0.8, 0.7, 0.6], "strong": [0.8, 0.8, 0.8, 0.8]})
    b = write_run(tmp_path / "b", {"weak": [0.7, 0.6, 0.5, 0.4], "strong": [0.9, 0.9, 0.9, 0.9]})
    out = diag.training_ratios([a, b], first=2)
    assert out["weak"]["first_steps_mean"] == pytest.approx((0.85 + 0.65) / 2)
    assert out["weak"]["all_steps_mean"] == pytest.approx((0.75 + 0.55) / 2)
    assert (out["weak"]["step_min"], out["weak"]["step_max"], out["weak"]["runs"]) == (0.4, 0.9, 2)
    assert out["weak"]["first_steps_outside_band"] == pytest.approx(0.812 - 0.75)
    assert out["strong"]["first_steps_outside_band"] == 0.0


def test_training_ratios_name_a_folder_without_metrics(tmp_path):
    with pytest.raises(SystemExit, match="metrics.jsonl: missing"):
        diag.training_ratios([tmp_path], first=3)
    write_run(tmp_path / "gspo", {"weak": [1.0]})
    (tmp_path / "gspo" / "metrics.jsonl").write_text(json.dumps({"step": 1, "weak/reward": 0.5}) + "\n")
    with pytest.raises(SystemExit, match="no <agent>/hacpo/cross_ratio_mean logged"):
        diag.training_ratios([tmp_path / "gspo"], first=3)
