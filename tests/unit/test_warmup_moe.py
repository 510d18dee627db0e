"""The supervised warm-up with MoE agents: the runtime it builds is closed (a Ray agent's placement
group must be free for the RL run's agent), and the MoE model fields never change a dense agent's
warm-up key (the shipped cpu_demo warm-ups keep matching)."""

from __future__ import annotations

import pytest

from hacrl_megatron.config import load_config
from hacrl_megatron.trainer import pretrain


class _Runtime:
    """Just what the warm-up touches before its first update fails."""

    name = "moe"
    closed = False

    class trainer:  # noqa: N801 (a namespace standing in for the agent)
        @staticmethod
        def train(batches, loss):
            raise RuntimeError("rank 1 died")

    def close(self) -> None:
        _Runtime.closed = True


def test_warm_up_closes_its_runtime_also_when_it_fails(tmp_path, monkeypatch):
    exp = load_config("cpu_demo_moe")
    monkeypatch.setattr(pretrain, "build_runtime", lambda *a, **k: _Runtime())
    monkeypatch.setattr(pretrain, "sft_batch", lambda rt, task, records: None)
    with pytest.raises(RuntimeError, match="rank 1 died"):
        pretrain.warm_up_agent(exp, 0, tmp_path / "out", verifier=None)
    assert _Runtime.closed and not (tmp_path / "out").exists()


def test_moe_fields_leave_dense_warmup_keys_alone():
    base = load_config("cpu_demo")
    changed = load_config("cpu_demo", ["agents.1.model.moe_topk=3", "agents.1.model.norm_topk_prob=false"])
    assert pretrain.warmup_key(changed, 1) == pretrain.warmup_key(base, 1)
    moe = load_config("cpu_demo_moe")
    assert pretrain.warmup_key(moe, 1) == pretrain.warmup_key(base, 1)  # the same dense agent: the shipped weights
    other = load_config("cpu_demo_moe", ["agents.0.model.moe_topk=1"])
    assert pretrain.warmup_key(other, 0) != pretrain.warmup_key(moe, 0)  # for MoE agents the fields count
