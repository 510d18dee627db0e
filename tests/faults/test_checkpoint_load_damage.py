"""Damage that only loading finds (the manifest verifies): a checkpoint of another model size, of three
agents, with a renamed agent, with a planted pickle in ``state.pt``; and an emptied ``COMPLETE`` marker
beside its manifest. With an older checkpoint the resumed run skips the damaged one like manifest-caught
damage and continues exactly like the unbroken run; without one, or when every checkpoint is damaged,
``hacrl train checkpoint.resume=true`` refuses (exit 2, one line naming the checkpoint or the folder)
instead of restarting at step 0 over the run's metrics and ``final/``.

One 4-step `hacrl train` run (checkpoints at steps 2 and 4) is copied for each case.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from hacrl_megatron.cli import main
from hacrl_megatron.trainer import checkpoint as ckpt
from hacrl_megatron.trainer.metrics import read_metrics
from tests.faults.trainer_helpers import preset_file, tiny


def _resign(c: Path) -> None:
    ckpt.write_manifest(c, int(c.name.split("-")[1]))  # a manifest that verifies: only loading finds the damage


def _other_size(c: Path) -> None:
    for shard in (c / "agents" / "llama" / "hf").glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({k: v[..., : max(1, v.shape[-1] // 2)].contiguous() for k, v in tensors.items()}, shard)
    _resign(c)


def _three_agents(c: Path) -> None:
    shutil.copytree(c / "agents" / "llama", c / "agents" / "third")
    _resign(c)


def _renamed(c: Path) -> None:
    os.replace(c / "agents" / "qwen3", c / "agents" / "qwen9")
    _resign(c)


class _Planted:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return os.system, (f"touch {self.target}",)


def _planted_pickle(c: Path) -> None:
    with open(c / "state.pt", "wb") as f:
        pickle.dump({"step": 4, "x": _Planted(c.parent / "PWNED")}, f)
    _resign(c)


def _state_of_another_step(c: Path) -> None:
    state = ckpt.load_state_file(c / "state.pt")
    torch.save({**state, "step": 99}, c / "state.pt")  # would end the run at once, past train.steps
    _resign(c)


def _emptied_marker(c: Path) -> None:
    (c / ckpt.MARKER).write_text("")


DAMAGE = {  # what is done to step-000004, and what the skip message must name
    "another model size": (_other_size, "size mismatch"),
    "three agents": (_three_agents, "checkpoint holds agents ['llama', 'qwen3', 'third']"),
    "renamed agent": (_renamed, "checkpoint holds agents ['llama', 'qwen9']"),
    "planted pickle in state.pt": (_planted_pickle, "state.pt: cannot be read as a run state"),
    "state.pt of another step": (_state_of_another_step, "state.pt holds step 99, not the folder's step 4"),
    "emptied COMPLETE marker": (_emptied_marker, "COMPLETE holds no checksum of the MANIFEST.json beside it"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A finished 4-step run through the CLI: (folder, its preset as a dict, its metrics rows)."""
    base = tmp_path_factory.mktemp("reference")
    exp = tiny(base, steps=4, every=2, checkpoint={"keep": 2})
    assert main(["train", "--preset", preset_file(base, exp)]) == 0
    return base, yaml.safe_load(Path(preset_file(base, exp)).read_text()), read_metrics(Path(exp.output_dir) / "metrics.jsonl")


def _copy(reference, tmp_path) -> tuple[str, Path]:
    base, preset, _ = reference
    shutil.copytree(base / "run", tmp_path / "run")
    preset = {**preset, "output_dir": str(tmp_path / "run")}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(preset, sort_keys=False))
    return str(path), tmp_path / "run"


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_found_while_loading_falls_back_to_the_previous_checkpoint(reference, tmp_path, caplog, case):
    preset, run = _copy(reference, tmp_path)
    harm, named = DAMAGE[case]
    harm(run / "checkpoints" / "step-000004")
    caplog.set_level(logging.WARNING, logger="hacrl_megatron")
    assert main(["train", "--preset", preset, "checkpoint.resume=true"]) == 0
    skips = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skips) == 1 and "step-000004" in skips[0] and named in skips[0], skips
    assert len(list((run / "checkpoints").glob("damaged-step-000004-*"))) == 1
    assert not (run / "checkpoints" / "PWNED").exists()  # the planted pickle ran nothing
    rows = {r["step"]: r for r in read_metrics(run / "metrics.jsonl")}
    for want in reference[2][2:]:  # steps 3 and 4 again, from step 2: as in the unbroken run
        for name in ("llama", "qwen3"):
            assert rows[want["step"]][f"{name}/hacpo/loss"] == pytest.approx(want[f"{name}/hacpo/loss"], rel=1e-6,
                                                                             abs=1e-9)


@pytest.mark.parametrize("case", ["another model size", "renamed agent", "planted pickle in state.pt"])
def test_the_only_checkpoint_damaged_while_loading_is_refused_and_kept(reference, tmp_path, capsys, case):
    preset, run = _copy(reference, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step-000002")
    DAMAGE[case][0](run / "checkpoints" / "step-000004")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"}
    assert main(["train", "--preset", preset, "checkpoint.resume=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"hacrl: checkpoint {run / 'checkpoints' / 'step-000004'} cannot be loaded into this run ("), err
    assert err.endswith(f"and no older checkpoint is left in {run / 'checkpoints'}; nothing was changed")
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"}
    assert {p for p in after if p.name != "run.json"} == {p for p in before if p.name != "run.json"}
    assert all(after[p] == data for p, data in before.items() if p.name != "run.json")  # metrics, final/, checkpoint


def test_every_checkpoint_damaged_refuses_to_restart_over_the_run(reference, tmp_path, capsys):
    preset, run = _copy(reference, tmp_path)
    for step in ("step-000002", "step-000004"):
        os.truncate(run / "checkpoints" / step / "state.pt", 10)
    metrics, final = (run / "metrics.jsonl").read_bytes(), sorted(p.name for p in (run / "final").iterdir())
    assert main(["train", "--preset", preset, "checkpoint.resume=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"hacrl: checkpoint.resume=true: no checkpoint in {run / 'checkpoints'} can be resumed, "
                          "every one is damaged (damaged-step-000002-"), err
    assert (run / "metrics.jsonl").read_bytes() == metrics and sorted(p.name for p in (run / "final").iterdir()) == final
    assert main(["train", "--preset", preset, "checkpoint.resume=true"]) == 2  # and again: nothing to resume
