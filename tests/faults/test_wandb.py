"""W&B: refused at `hacrl config` when not installed; entity, group, tags and run name reach wandb.init;
a resumed run continues its own W&B run (the run's id from run.json); the samples table is logged.
wandb itself is not installed in the test environment: a stand-in module records the calls."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from pathlib import Path

import pytest

from hacrl_megatron.cli import main
from hacrl_megatron.trainer import loop
from tests.faults.trainer_helpers import exp_with, tiny


class FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, row, step):
        self.calls.append(("log", step, sorted(row)))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # libraries probe find_spec("wandb")
    module.init = lambda **kwargs: calls.append(("init", kwargs)) or FakeRun(calls)

    class Table:
        def __init__(self, columns):
            self.columns, self.rows = columns, []
            calls.append(("table", self))

        def add_data(self, *values):
            self.rows.append(values)

    module.Table = Table
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_not_installed_is_refused_at_hacrl_config(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["config", "log.wandb=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("hacrl: configuration error: log.wandb='true': the wandb package is not installed here: "
                   "pip install wandb, or set log.wandb=false")


def test_wandb_keys_and_a_resumed_run_continues_its_wandb_run(tmp_path, fake_wandb):
    exp = exp_with(tiny(tmp_path, steps=2, every=2), log={
        "wandb": True, "wandb_entity": "team", "wandb_group": "seeds", "wandb_tags": ["hacpo", "demo"],
        "run_name": "first try", "samples_every": 1})
    loop.train(exp)
    run_id = json.loads((Path(exp.output_dir) / "run.json").read_text())["run_id"]
    (first,) = [c[1] for c in fake_wandb if c[0] == "init"]
    assert first["id"] == run_id and first["resume"] == "allow" and first["entity"] == "team"
    assert (first["group"], first["tags"], first["name"], first["project"]) == ("seeds", ["hacpo", "demo"],
                                                                                "first try", "hacrl")
    tables = [c[1] for c in fake_wandb if c[0] == "table"]
    assert tables and tables[0].columns[:4] == ["step", "prompt", "question", "reference"] and tables[0].rows
    assert [c[1] for c in fake_wandb if c[0] == "log" and "samples" in c[2]] == [1, 2]
    fake_wandb.clear()
    loop.train(exp_with(exp, train={"steps": 3}, checkpoint={"resume": True}))
    (again,) = [c[1] for c in fake_wandb if c[0] == "init"]
    assert again["id"] == run_id  # the same W&B run goes on
    assert [c[1] for c in fake_wandb if c[0] == "log" and "llama/reward_mean" in c[2]] == [3]


def test_wandb_tags_are_checked(capsys):
    assert main(["config", "log.wandb_tags=['']"]) == 2
    assert "log.wandb_tags=['']: tag '' must be 1 to 64 characters" in capsys.readouterr().err
