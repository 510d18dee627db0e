"""examples/moe_cpu: the MoE + dense pair of ``cpu_demo_moe`` trained with HACPO (DP2 × EP2 over gloo),
run as its README says with a short warm-up and two steps (slow)."""

from __future__ import annotations

import json

import pytest

from tests.examples.helpers import SHORT_TRAIN, readme_commands, run_failing, scratch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_moe_cpu(tmp_path):
    (train,) = readme_commands("moe_cpu")
    assert train == "hacrl train --preset cpu_demo_moe"
    work = scratch(tmp_path, "moe_cpu")
    out = run_failing(train, work, *SHORT_TRAIN, "agents.0.warmup_sft_max_steps=20")
    assert out.returncode == 0, f"{train}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    assert "warm-up moe: done: 20 steps" in out.stderr and "warm-up qwen3: shipped with the package" in out.stderr
    rows = [json.loads(line) for line in open(work / "runs/cpu_demo_moe/metrics.jsonl")]
    last = rows[-1]
    assert last["step"] == 2 and last["moe/trainer/ranks"] == 2.0
    assert last["moe/hacpo/moe/aux_loss"] > 0 and last["moe/hacpo/moe/aux_loss_coeff"] == 0.01
    assert last["moe/trainer/routing_replay_extra_sequences"] > 0  # the dense agent's responses
    assert abs(last["moe/sync_logp_diff"]) < 1e-3 and "qwen3/omega/moe" in last
