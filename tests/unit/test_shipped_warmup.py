"""The warm-up weights shipped for the CPU presets (hacrl_megatron/presets/warmup): they belong to the
current presets of SHIPPED, they are what their warmup.json says (greedy accuracy re-measured exactly),
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

SHIPPED = ("cpu_demo", "cpu_state", "cpu_size")  # the presets whose warm-ups the package carries
REGENERATE = "regenerate them: python tools/ship_warmup.py --preset <preset>"


def test_every_shipped_preset_agent_has_a_shipped_warmup_and_nothing_is_stale():
    keys: set[str] = set()
    for preset in SHIPPED:
        exp = load_config(preset)
        own = {pretrain.warmup_key(exp, i) for i in range(len(exp.agents))}
        shipped = {p.name for p in pretrain.SHIPPED_DIR.iterdir() if p.is_dir()}
        assert own <= shipped, f"{preset}'s warm-up keys {sorted(own - shipped)} are not shipped; {REGENERATE}"
        keys |= own
        for i, agent in enumerate(exp.agents):
            info = json.loads((pretrain.shipped_warmup(exp, i) / pretrain.INFO_FILE).read_text())
            assert info["agent"] == agent.name and info["greedy_accuracy"] >= agent.warmup_sft_target
    assert shipped <= keys, f"stale shipped warm-ups {sorted(shipped - keys)}; {REGENERATE}"


@pytest.mark.parametrize(("preset", "index"), [(p, i) for p in SHIPPED for i in (0, 1)])
def test_shipped_weights_reach_the_accuracy_they_record(preset, index):
    """The stopping rule's own measurement, repeated: greedy avg@1 on the warm-up's 100 eval items."""
    exp = load_config(preset)
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
    monkeypatch.setattr(pretrain, "warm_up_run", lambda e, snapshots, v: trained.append(snapshots) or {})
    dirs = pretrain.pretrain_all(exp)
    assert trained == []
    assert dirs == {a.name: pretrain.shipped_warmup(exp, i) for i, a in enumerate(exp.agents)}
    applied = pretrain.apply_warmup(exp)
    assert [a.init_checkpoint for a in applied.agents] == [str(dirs["llama"]), str(dirs["qwen3"])]

    def fake_train(e, snapshots, v):  # what warm_up_run leaves behind, without the training
        ((i, out),) = snapshots
        out.mkdir(parents=True)
        (out / pretrain.INFO_FILE).write_text(json.dumps({"steps": 1, "greedy_accuracy": 1.0}))
        trained.append(i)
        return {e.agents[i].name: {"steps": 1, "greedy_accuracy": 1.0, "seconds": 0.0}}

    monkeypatch.setattr(pretrain, "warm_up_run", fake_train)
    forced = pretrain.pretrain_all(exp, force=True)  # --force always trains, into the cache
    assert trained == [0, 1] and forced["llama"] == pretrain.warmup_dir(exp, 0)
    assert pretrain.pretrain_all(exp)["llama"] == pretrain.warmup_dir(exp, 0)  # the cache now wins
    other = load_config("cpu_demo", ["agents.1.warmup_sft_lr=0.002"])  # another key: not shipped
    assert pretrain.shipped_warmup(other, 1) is None and pretrain.shipped_warmup(other, 0) is not None
