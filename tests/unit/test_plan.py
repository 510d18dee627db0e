"""``hacrl plan``: memory accounting, fits / does not fit, the layout search, bad input, published recipes."""

from __future__ import annotations

import json

import pytest
import yaml

from hacrl_megatron.cli import main as hacrl
from hacrl_megatron.config import load_config
from hacrl_megatron.plan.gpus import gpu_by_name
from hacrl_megatron.plan.known_models import KNOWN_CONFIGS
from hacrl_megatron.plan.memory import GIB, layer_activation_bytes, model_state_bytes
from hacrl_megatron.plan.params import arch_from_config, stage_params
from hacrl_megatron.plan.search import Cluster, PlanError, partition

H100 = 80e9 / GIB  # an "80 GB" H100 in GiB


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "Llama-3.1-70B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(KNOWN_CONFIGS["Llama-3.1-70B"]))
    return str(folder)


def plan_json(capsys, *argv: str) -> dict:
    assert hacrl(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def plan_error(capsys, *argv: str) -> str:
    assert hacrl(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err  # one line
    return err


# --------------------------------------------------------------------------------------------
# accounting


def test_korthikanti_table2_for_the_gpt3_shape():
    """Our per-layer count reproduces the paper's Table 2 for its layer (4h GeLU MLP, MHA, dropout)."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    kw = dict(s=s, b=b, h=h, a=a, q=h, kv=h, f=4 * h, t=t, gated=False, dropout=True, flash=False)
    sbh = s * b * h
    assert layer_activation_bytes(sp=False, recompute="none", **kw) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert layer_activation_bytes(sp=True, recompute="none", **kw) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert layer_activation_bytes(sp=False, recompute="selective", **kw) == pytest.approx(sbh * (10 + 24 / t))
    assert layer_activation_bytes(sp=True, recompute="selective", **kw) == pytest.approx(sbh * 34 / t)
    assert layer_activation_bytes(sp=False, recompute="full", **kw) == 2 * sbh
    # fused attention keeps no score matrix: 'none' is 'selective' plus a fp32 log-sum-exp per head
    flash = dict(kw, flash=True)
    assert layer_activation_bytes(sp=False, recompute="none", **flash) == pytest.approx(
        sbh * (10 + 24 / t) + 4 * a * s * b / t)


def test_megatron_model_state_bytes_per_param():
    assert sum(model_state_bytes(1000, 1, False)) == 18_000  # 2 + 4 + 12
    assert sum(model_state_bytes(1000, 8, True)) == 6_000 + 12_000 / 8
    assert sum(model_state_bytes(1000, 4, True, grad_dtype="bfloat16")) == 4_000 + 3_000
    assert sum(model_state_bytes(1000, 1, False, dtype="float32")) == 16_000  # no master copy


def test_partition_in_proportion_to_cost():
    cl = Cluster(16, 8, H100, gpu_by_name("h100"))
    assert partition([70.6e9, 72.7e9], cl) == [64, 64]
    assert partition([8e9, 405e9], cl) == [8, 120]  # at least one node each
    one = Cluster(1, 8, H100, gpu_by_name("h100"))
    assert partition([4e9, 4e9], one) == [4, 4]
    assert partition([2e9, 4e9], one) == [4, 4]  # powers of two within a node, all GPUs used
    with pytest.raises(PlanError, match="cluster: 1 GPU"):
        partition([1, 1], Cluster(1, 1, H100, gpu_by_name("h100")))


# --------------------------------------------------------------------------------------------
# --model: one layout


def test_json_contract_and_terms(capsys, llama70b):
    out = plan_json(capsys, "--model", llama70b, "--tp", "8", "--pp", "8", "--dp", "1", "--gpu-memory-gib", f"{H100}")
    (agent,) = out["agents"]
    assert list(agent)[:6] == ["name", "layout", "params_per_stage", "memory_gib", "fits", "reasons"]
    assert agent["layout"] == {"tp": 8, "pp": 8, "dp": 1, "sequence_parallel": False, "recompute": "full",
                               "distributed_optimizer": True, "ep": 1, "etp": 1, "cp": 1}
    spec = arch_from_config(KNOWN_CONFIGS["Llama-3.1-70B"])
    assert agent["params_per_stage"] == list(stage_params(spec, 8, 8))
    assert agent["params_per_stage"][:2] == [1_201_045_504, 1_069_711_360]
    mem = agent["memory_gib"]
    assert set(mem) >= {"weights", "grads", "optimizer", "activations", "engine", "total"}
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"), abs=0.05)
    assert mem["engine"] == 0 and agent["fits"] and agent["reasons"] == []
    # most loaded stage is the first (PP micro-batches in flight); weights = 2 B × its params
    assert mem["weights"] == pytest.approx(1_201_045_504 * 2 / GIB, abs=0.01)
    assert "Korthikanti" in " ".join(out["assumptions"]["memory"]) and "tp" in out["assumptions"]["vocab_padding"]


def test_tp1_pp1_70b_does_not_fit_and_says_why(capsys, llama70b):
    out = plan_json(capsys, "--model", llama70b, "--tp", "1", "--pp", "1", "--dp", "64", "--gpu-memory-gib", f"{H100}")
    (agent,) = out["agents"]
    assert not agent["fits"]
    (reason,) = agent["reasons"]
    assert "over 74.5 GiB by" in reason and "largest term grads 262.8 GiB" in reason
    assert agent["memory_gib"]["weights"] == pytest.approx(70_553_706_496 * 2 / GIB, abs=0.01)


def test_nemo_rl_llama70b_grpo_recipe_fits_on_80gb_h100(capsys, llama70b):
    """NeMo-RL examples/configs/grpo_math_70B_megatron.yaml: 8 nodes × 8 GPUs, Megatron TP4·PP4 (DP4),
    no activation checkpointing, distributed optimizer, grads reduced in bf16, colocated vLLM at TP8
    with gpu_memory_utilization 0.6 (asleep while training; the policy offloads while generating),
    4096-token sequences, one per micro-batch."""
    recipe = ["--model", llama70b, "--tp", "4", "--pp", "4", "--dp", "4", "--gpu-memory-gib", f"{H100}",
              "--recompute", "none", "--grad-dtype", "bfloat16", "--seq-len", "4096", "--micro-batch-size", "1",
              "--rollout-mem-fraction", "0.6", "--engine-tp", "8"]
    (agent,) = plan_json(capsys, *recipe, "--colocation", "offload")["agents"]
    assert agent["fits"], agent["reasons"]
    assert 60 < agent["memory_gib"]["total"] < H100
    assert agent["rollout"]["engines"] == 8 and agent["rollout"]["kv_tokens"] > 100_000
    # with our trainer, which keeps its optimizer state while the engine generates, it does not fit
    (ours,) = plan_json(capsys, *recipe, "--colocation", "release")["agents"]
    assert not ours["fits"] and "rollout phase" in ours["reasons"][0]
    assert "largest term engine" in ours["reasons"][0]


def test_distributed_optimizer_and_recompute_change_the_right_terms(capsys, llama70b):
    base = ["--model", llama70b, "--tp", "8", "--pp", "4", "--dp", "2", "--gpu-memory-gib", f"{H100}"]
    dist = plan_json(capsys, *base)["agents"][0]["memory_gib"]
    plain = plan_json(capsys, *base, "--no-dist-opt")["agents"][0]["memory_gib"]
    assert plain["optimizer"] == pytest.approx(2 * dist["optimizer"], abs=0.02)
    assert plain["weights"] == dist["weights"] and plain["grads"] == dist["grads"]
    none = plan_json(capsys, *base, "--recompute", "none")["agents"][0]["memory_gib"]
    assert none["activations"] > 5 * dist["activations"] and none["optimizer"] == dist["optimizer"]


def test_fused_kernel_saving_is_the_materialised_logits(capsys, llama70b):
    out = plan_json(capsys, "--model", llama70b, "--tp", "8", "--pp", "1", "--dp", "1", "--gpu-memory-gib", "200",
                    "--seq-len", "8192", "--micro-batch-size", "2")
    saved = out["agents"][0]["logits_gib"]["saved_by_fused_kernel"]
    tokens, vocab = 8192 * 2, 128256 // 8
    assert saved == pytest.approx((6 * tokens * vocab - 8 * tokens - 2**28) / GIB, abs=0.01)


# --------------------------------------------------------------------------------------------
# bad input: one line naming the agent and the constraint, exit status 2


def test_bad_inputs(capsys, llama70b):
    common = ["--gpu-memory-gib", "80"]
    err = plan_error(capsys, "--model", llama70b, "--tp", "3", "--pp", "1", "--dp", "1", *common)
    assert err == "hacrl plan: agent 'Llama-3.1-70B': tp=3 does not divide num_attention_heads=64 (llama)"
    err = plan_error(capsys, "--model", llama70b, "--tp", "8", "--pp", "79", "--dp", "1", *common)
    assert "agent 'Llama-3.1-70B': pp=79 cannot split num_layers=80" in err
    err = plan_error(capsys, "--model", llama70b, "--tp", "8", "--pp", "1", "--dp", "1", "--gpu", "x100", *common)
    assert "--gpu 'x100' is not known" in err
    err = plan_error(capsys, "--preset", "multinode_llama70b_qwen72b", "--nodes", "1", "--gpus-per-node", "8", *common)
    assert "agent 'llama70b': no layout fits on its 4 GPU(s) of 80 GiB (cluster too small)" in err
    err = plan_error(capsys, "--preset", "paper_qwen3_4b_with_instruct", "--gpus-per-node", "8", *common)
    assert "--preset needs --nodes >= 1" in err


# --------------------------------------------------------------------------------------------
# --preset: the whole experiment


@pytest.fixture(scope="module")
def paper_plan():
    from argparse import Namespace

    from hacrl_megatron.plan.cli import _experiment

    args = Namespace(preset="paper_qwen3_4b_with_instruct", overrides=[], nodes=1, gpus_per_node=8,
                     gpu_memory_gib=H100, gpu="h100")
    return _experiment(args)


def test_paper_preset_plan_fits_and_round_trips(paper_plan, tmp_path):
    agents = paper_plan["agents"]
    assert [a["name"] for a in agents] == ["qwen3_4b", "qwen3_4b_instruct"]
    assert all(a["fits"] for a in agents) and [a["gpus"]["partition"] for a in agents] == [4, 4]
    assert all(a["memory_gib"]["total"] <= H100 for a in agents)
    # the overrides and the YAML are accepted by the config loader unchanged
    cfg = load_config("paper_qwen3_4b_with_instruct", paper_plan["overrides"])
    lay = agents[0]["layout"]
    assert (cfg.agents[0].parallel.tp, cfg.agents[0].parallel.pp, cfg.agents[0].parallel.dp) == \
        (lay["tp"], lay["pp"], lay["dp"])
    assert cfg.rollout.colocate  # one node: engines share the trainers' GPUs
    engine_ids = [set(a.rollout_gpu_ids) for a in cfg.agents]
    assert engine_ids[0] <= set(range(4)) and engine_ids[1] <= set(range(4, 8))
    path = tmp_path / "planned.yaml"
    path.write_text(paper_plan["preset_yaml"])
    assert load_config(str(path)).to_dict() == cfg.to_dict()
    stages = paper_plan["step_stages_s"]
    assert paper_plan["step_time_s"] == pytest.approx(sum(stages.values()), abs=0.05)
    assert paper_plan["step_gspo_x2_s"]["rollout_s"] > 1.5 * stages["rollout_s"]  # GSPO×2 samples twice as much


def test_70b_preset_is_what_the_planner_proposes():
    from argparse import Namespace

    from hacrl_megatron.plan.cli import _experiment

    args = Namespace(preset="multinode_llama70b_qwen72b", overrides=[], nodes=9, gpus_per_node=8,
                     gpu_memory_gib=H100, gpu="h100")
    plan = _experiment(args)
    assert all(a["fits"] for a in plan["agents"])
    assert [a["gpus"]["trainer"] for a in plan["agents"]] == [32, 32]  # 4 whole nodes each
    preset = load_config("multinode_llama70b_qwen72b")
    assert load_config("multinode_llama70b_qwen72b", plan["overrides"]).to_dict() == preset.to_dict()
    assert preset.rollout.weight_sync == "distributed" and not preset.rollout.colocate
    assert yaml.safe_load(plan["preset_yaml"])["agents"][1]["rollout_gpu_ids"] == [4, 5, 6, 7]
