"""Second runs: a folder whose run never checkpointed is taken over (its files kept aside), `hacrl train
--new` starts in a fresh sibling folder, and checkpoint.export_best keeps each agent's best evaluation."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hacrl_megatron.cli import main, new_run_folders
from hacrl_megatron.config import ConfigError
from hacrl_megatron.trainer import loop
from hacrl_megatron.trainer.metrics import read_metrics
from hacrl_megatron.trainer.run_folder import ABANDONED_PREFIX, check_run_folder
from tests.faults.trainer_helpers import exp_with, preset_file, tiny


def test_a_folder_whose_run_never_checkpointed_is_taken_over_keeping_its_files(tmp_path, caplog):
    exp = tiny(tmp_path, steps=1, every=0)
    out = Path(exp.output_dir)
    (out / "tensorboard").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "time": 1.0}\n')  # a run that crashed at step 1
    caplog.set_level(logging.WARNING, logger="hacrl_megatron")
    check_run_folder(exp)
    (aside,) = [p for p in out.iterdir() if p.name.startswith(ABANDONED_PREFIX)]
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "tensorboard"]
    assert not (out / "metrics.jsonl").exists()
    assert "stopped before its first checkpoint" in caplog.text and str(aside) in caplog.text


def test_a_finished_run_is_still_refused_and_new_starts_a_sibling(tmp_path, capsys):
    exp = exp_with(tiny(tmp_path, steps=1, every=0), train={"eval_every": 0})
    preset = preset_file(tmp_path, exp)
    assert main(["train", "--preset", preset]) == 0
    assert main(["train", "--preset", preset]) == 2  # final/ written: a finished run is never taken over
    assert "already holds a run (metrics.jsonl, final" in capsys.readouterr().err
    assert main(["train", "--preset", preset, "--new"]) == 0
    err = capsys.readouterr().err
    (sibling,) = [p for p in tmp_path.iterdir() if p.name.startswith("run-")]
    assert f"hacrl: --new: this run writes to {sibling}" in err
    assert [r["step"] for r in read_metrics(sibling / "metrics.jsonl")] == [1]
    assert (sibling / "final" / "llama" / "config.json").is_file()
    try:
        new_run_folders(exp_with(exp, checkpoint={"resume": True}))
    except ConfigError as err:
        assert "--new starts a fresh run in a new folder: it cannot continue one" in str(err)
    else:
        raise AssertionError("--new with checkpoint.resume=true was accepted")
    named = new_run_folders(exp_with(exp, checkpoint={"dir": str(tmp_path / "ck")}))
    assert named.checkpoint.dir.startswith(str(tmp_path / "ck") + "-") and named.output_dir.startswith(exp.output_dir + "-")


def test_export_best_keeps_each_agents_best_evaluation(tmp_path, capsys):
    exp = exp_with(tiny(tmp_path, steps=3, every=0), train={"eval_every": 1}, data={"eval_size": 6},
                   checkpoint={"export_best": True})
    run = loop.train(exp)
    out = capsys.readouterr().out
    for agent, values in run.history.items():
        info = json.loads((Path(exp.output_dir) / "best" / agent / "hacrl_best.json").read_text())
        best = max(values)
        assert info == {"step": values.index(best), "score": best, "metric": "eval_accuracy"}  # the first best
        assert (Path(exp.output_dir) / "best" / agent / "config.json").is_file()
        assert f"{agent}: best so far (step 0, eval_accuracy {values[0]:.3f})" in out
        assert run.best[agent] == [best, values.index(best)]


def test_export_best_needs_an_evaluation(capsys):
    assert main(["config", "checkpoint.export_best=true", "train.eval_every=0"]) == 2
    assert "checkpoint.export_best=True: needs evaluations to pick the best step" in capsys.readouterr().err
