"""The warm-up weights shipped for the CPU demo (hacrl_megatron/presets/warmup): they belong to the
current cpu_demo preset, they are what their warmup.json says (greedy accuracy re-measured exactly),
a fresh cache uses them instead of training, and `--force` or any other key trains.

Regenerating them (tools/ship_warmup.py) is the slow test tests/e2e/test_shipped_warmup.py."""

from __future__ import annotations

import json

import pytest

from hacrl_megatron.config import load_config
from hacrl_megatron.data import make_task
from hacrl_megatron.eval.evaluate import EvalSettings, evaluate
from hacrl_megatron.eval.run import load_hf_agent
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.trainer import pretrain

REGENERATE = "regenerate them: python tools/ship_warmup.py --preset cpu_demo"


def test_every_cpu_demo_agent_has_a_shipped_warmup_and_nothing_is_stale():
    exp = load_config("cpu_demo")
    keys = {pretrain.warmup_key(exp, i) for i in range(len(exp.agents))}
    shipped = {p.name for p in pretrain.SHIPPED_DIR.iterdir() if p.is_dir()}
    assert keys <= shipped, f"cpu_demo's warm-up keys {sorted(keys - shipped)} are not shipped; {REGENERATE}"
    assert shipped <= keys, f"stale shipped warm-ups {sorted(shipped - keys)}; {REGENERATE}"
    for i, agent in enumerate(exp.agents):
        info = json.loads((pretrain.shipped_warmup(exp, i) / pretrain.INFO_FILE).read_text())
        assert info["agent"] == agent.name and info["greedy_accuracy"] >= agent.warmup_sft_target


@pytest.mark.parametrize("index", [0, 1])
def test_shipped_weights_reach_the_accuracy_they_record(index):
    """The stopping rule's own measurement, repeated: greedy avg@1 on the warm-up's 100 eval items."""
    exp = load_config("cpu_demo")
    folder = pretrain.shipped_warmup(exp, index)
    info = json.loads((folder / pretrain.INFO_FILE).read_text())
    engine, tokenizer = load_hf_agent(folder)
    task = make_task(exp.data.task, exp.data.difficulty, exp.data.seed + 1)  # as warm_up_agent draws it
    settings = EvalSettings(greedy=True, max_new_tokens=exp.rollout.max_response_len, template="plain")
    with VerifierPool(num_workers=0) as verifier:
        result = evaluate(engine, tokenizer, {"eval": task.eval_set(pretrain.EVAL_ITEMS)}, settings,
                          verifier=verifier)
    assert result.benchmarks["eval"].primary == pytest.approx(info["greedy_accuracy"], abs=0.011)


def test_fresh_cache_uses_shipped_weights_without_training(tmp_path, monkeypatch):
    monkeypatch.setenv("HACRL_CACHE", str(tmp_path / "cache"))
    exp = load_config("cpu_demo")
    trained = []
    monkeypatch.setattr(pretrain, "warm_up_agent", lambda e, i, out, v: trained.append(i) or {})
    dirs = pretrain.pretrain_all(exp)
    assert trained == []
    assert dirs == {a.name: pretrain.shipped_warmup(exp, i) for i, a in enumerate(exp.agents)}
    applied = pretrain.apply_warmup(exp)
    assert [a.init_checkpoint for a in applied.agents] == [str(dirs["llama"]), str(dirs["qwen3"])]

    def fake_train(e, i, out, v):  # what warm_up_agent leaves behind, without the training
        out.mkdir(parents=True)
        (out / pretrain.INFO_FILE).write_text(json.dumps({"steps": 1, "greedy_accuracy": 1.0}))
        trained.append(i)
        return {"steps": 1, "greedy_accuracy": 1.0, "seconds": 0.0}

    monkeypatch.setattr(pretrain, "warm_up_agent", fake_train)
    forced = pretrain.pretrain_all(exp, force=True)  # --force always trains, into the cache
    assert trained == [0, 1] and forced["llama"] == pretrain.warmup_dir(exp, 0)
    assert pretrain.pretrain_all(exp)["llama"] == pretrain.warmup_dir(exp, 0)  # the cache now wins
    other = load_config("cpu_demo", ["agents.1.warmup_sft_lr=0.002"])  # another key: not shipped
    assert pretrain.shipped_warmup(other, 1) is None and pretrain.shipped_warmup(other, 0) is not None
