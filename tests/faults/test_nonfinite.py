"""The non-finite guard: a step whose loss, gradient norm or updated weights are not finite stops
`hacrl train` (exit 1, one line naming the agent, the step and the value, and the last checkpoint)
before that step's checkpoint is written; the previous checkpoint stays the newest and loads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hacrl_megatron.agents.hf import HFAgent
from hacrl_megatron.cli import main
from hacrl_megatron.trainer.checkpoint import find_resume_checkpoint
from hacrl_megatron.trainer.guards import NonFiniteError, check_finite_step, guarded_step
from hacrl_megatron.trainer.run_folder import checkpoint_dir
from tests.faults.trainer_helpers import preset_file, tiny

torch.set_num_threads(1)


def _fail_at_step(monkeypatch, step: int, how: str) -> None:
    """From training step ``step`` on, agent llama's update returns a NaN loss or leaves NaN weights."""
    real = HFAgent.train
    calls = {"llama": 0}

    def train(self, mini_batches, loss_fn, temperature=1.0):
        out = real(self, mini_batches, loss_fn, temperature)
        if self.name == "llama":
            calls["llama"] += 1
            if calls["llama"] >= step:
                if how == "loss":
                    out[-1]["loss"] = float("nan")
                else:  # an update that overflowed: the loss was finite, the weights are not
                    with torch.no_grad():
                        for p in self.model.parameters():
                            p.fill_(float("inf"))
        return out

    monkeypatch.setattr(HFAgent, "train", train)


@pytest.mark.parametrize("how, named", [("loss", "hacpo/loss = nan"), ("weights", "sync_logp_diff = nan")])
def test_a_non_finite_step_stops_before_its_checkpoint_and_names_agent_step_value(tmp_path, monkeypatch, capsys,
                                                                                   how, named):
    exp = tiny(tmp_path, steps=3, every=1)
    root = checkpoint_dir(exp)
    _fail_at_step(monkeypatch, 2, how)
    assert main(["train", "--preset", preset_file(tmp_path, exp)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hacrl:")]
    assert lines == [f"hacrl: training diverged: agent llama, step 2: {named}; stopped before step 2's checkpoint "
                     "(lower agents.*.lr or train.grad_clip, then resume); last checkpoint: "
                     f"{root / 'step-000001'} (continue with checkpoint.resume=true)"], err
    assert "Traceback" not in err
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000001"]
    assert find_resume_checkpoint(root) == root / "step-000001"  # complete and verified
    assert not (Path(exp.output_dir) / "final").exists()  # nothing diverged is exported


def test_guard_checks_loss_grad_norm_only_when_clipped_and_converts_optimizer_refusals():
    metrics = {"a/hacpo/loss": 1.0, "a/hacpo/grad_norm": float("nan"), "a/sync_logp_diff": 0.0}
    check_finite_step(3, metrics, ["a"], grad_clip=0.0)  # megatron-core reports no norm without clipping
    with pytest.raises(NonFiniteError, match=r"^training diverged: agent a, step 3: hacpo/grad_norm = nan;"):
        check_finite_step(3, metrics, ["a"], grad_clip=1.0)
    run = SimpleNamespace(step=4, runtimes=[SimpleNamespace(name="a")], exp=SimpleNamespace(
        train=SimpleNamespace(grad_clip=1.0)))

    def refused(run):
        raise FloatingPointError("agent a: optimizer step 9 skipped (inf/nan gradients)")

    with pytest.raises(NonFiniteError, match=r"^training diverged at step 5: agent a: optimizer step 9 skipped "
                                             r"\(inf/nan gradients\); stopped before step 5's checkpoint"):
        guarded_step(run, refused)
    assert guarded_step(run, lambda r: {"a/hacpo/loss": 0.5}) == {"a/hacpo/loss": 0.5}
