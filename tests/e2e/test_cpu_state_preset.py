"""`hacrl train --preset cpu_state` from a fresh cache: the two snapshots come from the package's
shipped warm-up (nothing trained, no file outside the package), and one HACPO step logs each learner's
cross ratio next to its self ratio (tiny step: 2 prompts, G = 2, 8 evaluation problems)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hacrl_megatron.config import load_config
from hacrl_megatron.trainer import pretrain


@pytest.mark.parametrize("preset", ["cpu_state", "cpu_size"])
def test_one_step_from_the_shipped_warmup(tmp_path, preset):
    exp = load_config(preset)
    assert all(pretrain.shipped_warmup(exp, i) is not None for i in range(len(exp.agents)))
    env = {**os.environ, "HACRL_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "hacrl_megatron", "train", "--preset", preset, f"output_dir={tmp_path / 'run'}",
           "train.steps=1", "train.prompts_per_step=2", "rollout.samples_per_prompt=2", "data.eval_size=8",
           "train.eval_every=1", "checkpoint.every=0", "log.progress=false", "log.tensorboard=false",
           "train.verifier_workers=0"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "shipped with the package" in done.stderr and "warm-up" in done.stderr
    assert not (tmp_path / "cache" / "warmup").exists()  # nothing trained into the cache
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r["step"] == 1)
    for agent in exp.agents:
        assert 0 < step[f"{agent.name}/hacpo/cross_ratio_mean"] < 10
        # own samples: s = 1 at the first update, then one small-lr update away (mean over the 2 mini-batches)
        assert step[f"{agent.name}/hacpo/self_ratio_mean"] == pytest.approx(1.0, abs=0.05)
