"""Shared pieces of the trainer fault tests: a tiny two-agent run (seconds on CPU) and its preset file.

The tiny run is the one of tests/e2e/test_trainer.py (random tiny llama + qwen3, a parity
verifier that gives non-zero advantages); the preset file lets the same run go through `hacrl train`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.trainer import loop
from tests.e2e.test_trainer import parity_reward, tiny_exp


def exp_with(exp, **sections):
    """``exp`` with fields replaced per section: ``exp_with(exp, checkpoint={"every": 2})``."""
    return dataclasses.replace(exp, **{name: dataclasses.replace(getattr(exp, name), **fields)
                                       for name, fields in sections.items()})


def tiny(tmp_path: Path, backend: str = "hf", steps: int = 4, every: int = 2, **sections):
    exp = tiny_exp(tmp_path, backend=backend, steps=steps)
    return exp_with(exp, checkpoint={"every": every, **sections.pop("checkpoint", {})}, **sections)


def preset_file(tmp_path: Path, exp, name: str = "tiny.yaml") -> str:
    """Write ``exp`` as a preset YAML for `hacrl train --preset FILE`."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(exp.to_dict(), sort_keys=False))
    return str(path)


def start(exp):
    """``loop.setup`` with the parity verifier in-process (no verifier processes)."""
    run = loop.setup(exp)
    run.verifier.close()
    run.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
    return run


def steps_with_checkpoints(exp, steps: int) -> list[dict[str, float]]:
    """Train ``steps`` steps, saving every ``checkpoint.every``; returns the per-step metrics."""
    run, history = start(exp), []
    try:
        for _ in range(steps):
            history.append(loop.train_step(run))
            if exp.checkpoint.every and run.step % exp.checkpoint.every == 0:
                loop._save(run)
    finally:
        for rt in run.runtimes:
            rt.close()
    return history


def resume_and_step(exp, steps: int):
    """Resume ``exp`` (checkpoint.resume=true) and train ``steps`` more steps: (run, metrics)."""
    run = start(exp_with(exp, checkpoint={"resume": True}))
    assert loop._resume(run)
    history = [loop.train_step(run) for _ in range(steps)]
    return run, history


def same_losses(a: list[dict], b: list[dict], names=("llama", "qwen3")) -> None:
    """Two runs' step metrics agree (the resumed one continues the original exactly)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for name in names:
            assert x[f"{name}/hacpo/loss"] == y[f"{name}/hacpo/loss"]
            assert x[f"{name}/reward_mean"] == y[f"{name}/reward_mean"]
