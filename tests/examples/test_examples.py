"""Every CPU example in examples/, run as its README says with fewer steps (slow: minutes each)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from tests.examples.helpers import EXAMPLES, SHORT_TRAIN, readme_commands, run, run_failing, scratch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # minutes each; more on a shared machine


def test_quickstart(tmp_path):
    train, plot, evaluate = readme_commands("quickstart")
    assert (train, plot.split()[:2], evaluate.split()[:3]) == \
        ("hacrl train", ["python", "tools/plot_metrics.py"], ["hacrl", "eval", "--agent"])
    work = scratch(tmp_path, "quickstart")
    out = run(train, work, *SHORT_TRAIN)
    assert "warm-up llama: shipped with the package" in out.stderr  # no supervised phase on a first run
    assert "warm-up qwen3: shipped with the package" in out.stderr
    assert "| llama |" in out.stdout and "| qwen3 |" in out.stdout
    rows = [json.loads(line) for line in open(work / "runs/cpu_demo/metrics.jsonl")]
    assert rows[-1]["step"] == 2 and "llama/omega/qwen3" in rows[-1]
    run(plot, work)
    assert (work / "runs/cpu_demo/curves.png").stat().st_size > 10_000
    out = run(evaluate, work, "--limit", "20")
    assert "| llama" in out.stdout and "addition" in out.stdout
    (result,) = json.loads((work / "runs/cpu_demo/eval_llama/results.json").read_text())["results"]
    assert result["model"] == "llama" and 0.0 <= result["benchmarks"]["addition"]["primary"] <= 1.0


def test_custom_task_checker_logic():
    spec = importlib.util.spec_from_file_location("example_checker", EXAMPLES / "custom_task/checker.py")
    checker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker)
    assert checker.score("\\boxed{400+57}", "400+57") == 1.0
    assert checker.score("so \\boxed{228 + 229}", "400+57") == 1.0  # any pair that adds up
    assert checker.score("\\boxed{457}", "400+57") == 0.0 and checker.score("\\boxed{300+57}", "400+57") == 0.0
    assert checker.score("400+57", "400+57") == 0.0  # no box, no answer


def test_custom_task(tmp_path):
    make, train, evaluate = readme_commands("custom_task")
    work = scratch(tmp_path, "custom_task")
    for name in ("train.jsonl", "test.jsonl"):
        (work / "examples/custom_task/data" / name).unlink()
    run(make, work)
    for name in ("train.jsonl", "test.jsonl"):  # the committed files are what make_data.py writes
        assert (work / "examples/custom_task/data" / name).read_bytes() == \
            (EXAMPLES / "custom_task/data" / name).read_bytes()
    out = run(train, work, *SHORT_TRAIN, "agents.0.warmup_sft_max_steps=20", "agents.1.warmup_sft_max_steps=20")
    assert "warm-up llama: done: 20 steps" in out.stderr and "| qwen3 |" in out.stdout
    out = run(evaluate, work, "--limit", "10")
    assert "| llama" in out.stdout and "custom" in out.stdout
    # the checker really is the reward: one that accepts everything gives every rollout reward 1
    (work / "always.py").write_text("def one(response, reference):\n    return 1.0\n")
    run(train, work, *SHORT_TRAIN, "train.sft_warmup=false", "data.checker=always.py:one", "output_dir=runs/always")
    rows = [json.loads(line) for line in open(work / "runs/always/metrics.jsonl")]
    assert rows[-1]["llama/reward_mean"] == 1.0 and rows[-1]["qwen3/reward_mean"] == 1.0
    bad = run_failing(train, work, "data.checker=examples/custom_task/checker.py:nope")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "data.checker='examples/custom_task/checker.py:nope'" in bad.stderr and "has no 'nope'" in bad.stderr


def test_three_agents(tmp_path):
    make, train, plot = readme_commands("three_agents")
    work = scratch(tmp_path, "three_agents")
    committed = {p.name: p.read_bytes() for p in (EXAMPLES / "three_agents/boxed_tokenizer").iterdir()}
    shutil.rmtree(work / "examples/three_agents/boxed_tokenizer")
    run(make, work)
    regenerated = {p.name: p.read_bytes() for p in (work / "examples/three_agents/boxed_tokenizer").iterdir()}
    assert regenerated == committed  # the committed folder is what make_tokenizer.py writes
    out = run(train, work, *SHORT_TRAIN, "agents.2.warmup_sft_max_steps=20")
    assert "warm-up llama: shipped with the package" in out.stderr and "warm-up qwen2: done: 20 steps" in out.stderr
    last = [json.loads(line) for line in open(work / "runs/three_agents/metrics.jsonl")][-1]
    names = ("llama", "qwen3", "qwen2")
    omega = [[last[f"{k}/omega/{j}"] for j in names] for k in names]
    for k in range(3):
        assert omega[k][k] == 1.0 and 0.0 <= last[f"{names[k]}/capability"] <= 1.0
        for j in range(3):
            assert 0.1 <= omega[k][j] <= 10.0
            if 0.1 < omega[k][j] < 10.0:  # eq. 9 without the clip: P̂k/P̂j · P̂j/P̂k = 1
                assert omega[k][j] * omega[j][k] == pytest.approx(1.0, rel=1e-5)
    for k in names:  # every learner received re-tokenized responses from both other agents
        assert all(f"{k}/exchange/from_{j}/token_ratio" in last for j in names if j != k)
    run(plot, work)
    assert (work / "runs/three_agents/curves.png").stat().st_size > 10_000


def test_bring_your_own_models(tmp_path):
    from safetensors.torch import load_file

    make, to_tp2, to_pp2, back, train = readme_commands("bring_your_own_models")
    work = scratch(tmp_path, "bring_your_own_models")
    for command in (make, to_tp2, to_pp2, back):
        run(command, work)
    original, returned = (load_file(work / f"models/{m}/model.safetensors") for m in ("tiny_llama", "tiny_llama_back"))
    assert sorted(original) == sorted(returned)
    assert all(torch.equal(original[k], returned[k]) for k in original)  # HF -> Megatron TP=2 -> HF, bit for bit
    for ckpt in ("tiny_llama_tp2", "tiny_qwen3_pp2"):
        assert (work / "ckpt" / ckpt / "metadata.json").is_file() and (work / "ckpt" / ckpt / "tokenizer").is_dir()
    run(train, work, *SHORT_TRAIN)
    last = [json.loads(line) for line in open(work / "runs/byo/metrics.jsonl")][-1]
    assert last["step"] == 2
    for name in ("tiny_llama", "tiny_qwen3"):
        assert last[f"{name}/sync_logp_diff"] < 1e-3 * 16  # Megatron at TP=2 / PP=2 vs the HF engine
        assert (work / "runs/byo/final" / name / "config.json").is_file()
