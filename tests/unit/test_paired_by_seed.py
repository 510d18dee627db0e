"""benchmarks/paired_by_seed.py: reference − method differences paired by seed, with standard errors,
on a made-up tools/compare.py folder (greedy curves in compare.json, pass@k in metrics.jsonl)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("paired_by_seed", ROOT / "benchmarks" / "paired_by_seed.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

CURVES = {  # (method, seed) → greedy accuracy at steps 0, 5, 10, 15, 20 of agent "weak"
    ("hacpo", 1): [0.6, 0.6, 0.7, 0.8, 0.9], ("gspo_x2", 1): [0.6, 0.6, 0.6, 0.7, 0.7],
    ("hacpo", 2): [0.6, 0.6, 0.6, 0.6, 0.6], ("gspo_x2", 2): [0.6, 0.6, 0.7, 0.7, 0.8],
    ("hacpo", 3): [0.6, 0.6, 0.7, 0.7, 0.7], ("gspo_x2", 3): [0.6, 0.6, 0.7, 0.7, 0.7],
}


def make_compare(out: Path) -> None:
    runs = []
    for (method, seed), acc in CURVES.items():
        runs.append({"method": method, "seed": seed, "agents": {"weak": {"steps": [0, 5, 10, 15, 20], "accuracy": acc}}})
        folder = out / f"{method}-seed{seed}"
        folder.mkdir(parents=True)
        rows = [{"step": 20, "weak/eval/addition_cot/pass@4": acc[-1] + 0.1, "weak/eval/addition_cot/avg@4": 0.5}]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "compare.json").write_text(json.dumps({"summary": {}, "runs": runs}))


def test_paired_differences_and_standard_errors(tmp_path, capsys):
    make_compare(tmp_path)
    table = tool.main([str(tmp_path), "--json", str(tmp_path / "p.json")])["weak"]["gspo_x2"]
    final = table["final"]
    assert final["diffs"] == pytest.approx([0.2, -0.2, 0.0]) and final["seeds"] == [1, 2, 3]
    assert final["mean"] == pytest.approx(0.0) and final["se"] == pytest.approx(0.2 / 3**0.5)
    assert (final["above"], final["level"], final["below"]) == (1, 1, 1)
    # last-3 means: seed 1 0.8 vs 0.6667, seed 2 0.6 vs 0.7333, seed 3 equal
    assert table["last3"]["diffs"] == pytest.approx([0.4 / 3, -0.4 / 3, 0.0])
    assert table["addition_cot pass@4"]["diffs"] == pytest.approx([0.2, -0.2, 0.0])
    assert "| weak | gspo_x2 | final | 3 | +0.000 ± 0.115 | 1 / 1 / 1 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "p.json").read_text())["weak"]["gspo_x2"]["final"]["n"] == 3


def test_missing_compare_json_is_named(tmp_path):
    with pytest.raises(SystemExit, match="compare.json: missing"):
        tool.main([str(tmp_path)])


def test_include_paired_fills_seeds_whose_run_folders_are_gone(tmp_path):
    import shutil

    full, part = tmp_path / "full", tmp_path / "part"
    make_compare(full)
    earlier = tool.main([str(full), "--json", str(tmp_path / "all.json")])
    make_compare(part)
    for method in ("hacpo", "gspo_x2"):  # seed 1 ran in another session: only its paired numbers remain
        shutil.rmtree(part / f"{method}-seed1")
    (tmp_path / "seed1.json").write_text(json.dumps(
        {"weak": {"gspo_x2": {m: tool.summary([1], [v["diffs"][0]]) for m, v in earlier["weak"]["gspo_x2"].items()}}}))
    with pytest.raises(SystemExit, match="seed 1 is in compare.json but its run folders are gone"):
        tool.main([str(part)])
    merged = tool.main([str(part), "--include-paired", str(tmp_path / "seed1.json")])
    assert merged == earlier  # same seeds, differences, means, standard errors and counts
    # a seed held by both must agree
    bad = json.loads((tmp_path / "seed1.json").read_text())
    bad["weak"]["gspo_x2"]["final"] = tool.summary([1, 2], [0.2, 0.5])
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(SystemExit, match="weak gspo_x2 final seed 2"):
        tool.main([str(part), "--include-paired", str(tmp_path / "bad.json")])
