"""tools/plot_metrics.py on synthetic metrics.jsonl files: curves, PNG output, errors."""

import json
from pathlib import Path

import pytest

from tests.unit.tool_loading import load_tool

pm = load_tool("plot_metrics")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(folder: Path, agents=("llama", "qwen3"), steps=6, cross=True, offset=0.0):
    """A run as the trainer writes it: step-0 eval row, then one row per step, eval every 2 steps."""
    folder.mkdir(parents=True)
    rows = [{"step": 0, "time": 0.0, **{f"{a}/eval_accuracy": 0.1 * (i + 1) for i, a in enumerate(agents)}}]
    for s in range(1, steps + 1):
        row = {"step": s, "time": float(s), "time/train_s": 0.5 + s}
        for i, a in enumerate(agents):
            row[f"{a}/reward_mean"] = offset + 0.1 * s + i
            row[f"{a}/capability"] = 0.2 + 0.01 * s
            if cross:
                row[f"{a}/hacpo/cross_clipfrac"] = 0.9 - 0.01 * s
            if s % 2 == 0:
                row[f"{a}/eval_accuracy"] = 0.1 * (i + 1) + 0.05 * s
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_lines_are_per_run_and_agent_with_the_logged_values(tmp_path):
    runs = pm.load_runs([write_run(tmp_path / "a"), write_run(tmp_path / "b", offset=1.0)])
    lines = pm.lines_for(runs, "reward_mean")
    assert [label for _, label, _, _ in lines] == ["a: llama", "a: qwen3", "b: llama", "b: qwen3"]
    _, _, steps, values = lines[3]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert values == pytest.approx([2.0 + 0.1 * s for s in range(1, 7)])
    _, _, steps, values = pm.lines_for(runs, "eval_accuracy")[1]  # sparse: step 0 and every 2nd step
    assert steps == [0, 2, 4, 6]
    assert values == pytest.approx([0.2, 0.3, 0.4, 0.5])
    wide = pm.lines_for(runs, "time/train_s")  # run-wide key: one line per run
    assert [label for _, label, _, _ in wide] == ["a", "b"]


def test_default_plot_writes_a_png_with_every_default_key(tmp_path):
    out = tmp_path / "plots" / "curves.png"
    assert pm.main([str(write_run(tmp_path / "a")), str(write_run(tmp_path / "b") / "metrics.jsonl"),
                    "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_default_keys_absent_from_every_run_are_skipped_but_asked_keys_are_required(tmp_path):
    runs = pm.load_runs([write_run(tmp_path / "grpo", cross=False)])
    drawn = pm.plot(runs, list(pm.DEFAULT_KEYS), tmp_path / "c.png", strict=False)
    assert drawn == ["reward_mean", "eval_accuracy", "capability"]
    with pytest.raises(pm.PlotError, match="unknown key 'hacpo/cross_clipfrac'.*available: .*reward_mean"):
        pm.plot(runs, ["hacpo/cross_clipfrac"], tmp_path / "d.png", strict=True)


def test_cli_errors_name_the_missing_file_or_unknown_key(tmp_path, capsys):
    with pytest.raises(SystemExit):
        pm.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.png")])
    assert "nowhere" in capsys.readouterr().err
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(SystemExit):
        pm.main([str(tmp_path / "empty_run"), "--out", str(tmp_path / "x.png")])
    assert "empty_run/metrics.jsonl: no metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pm.main([str(write_run(tmp_path / "a")), "--out", str(tmp_path / "x.png"), "--keys", "reward_mean", "nope"])
    assert "unknown key 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_colliding_folder_names_are_labelled_by_path(tmp_path):
    runs = pm.load_runs([write_run(tmp_path / "x" / "run"), write_run(tmp_path / "y" / "run")])
    assert list(runs) == [str(tmp_path / "x" / "run"), str(tmp_path / "y" / "run")]


def test_benchmark_avg_keys_get_a_default_panel_each(tmp_path):
    folder = write_run(tmp_path / "a")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if row["step"] % 2 == 0:  # evaluated with data.eval_benchmarks=[addition, gsm8k], k = 4
            for agent in ("llama", "qwen3"):
                row.update({f"{agent}/eval/addition/avg@4": 0.5, f"{agent}/eval/addition/pass@4": 0.7,
                            f"{agent}/eval/gsm8k/avg@4": 0.25})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = pm.load_runs([folder])
    assert pm.default_keys(runs) == [*pm.DEFAULT_KEYS, "eval/addition/avg@4", "eval/gsm8k/avg@4"]
    _, label, steps, values = pm.lines_for(runs, "eval/gsm8k/avg@4")[1]
    assert (label, steps, values) == ("a: qwen3", [0, 2, 4, 6], [0.25] * 4)
    out = tmp_path / "c.png"
    assert pm.main([str(folder), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)
