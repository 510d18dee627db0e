"""Context parallelism in the planner (plan/memory.py, plan/timing.py, ``hacrl plan --cp``, a preset's
``parallel.cp``): the layout's GPUs are tp·pp·cp·dp, each rank holds s/cp tokens of every row
(activations and the log-prob head divided by cp), the distributed optimizer shards over dp·cp, and the
ring exchange of keys and values is its own time term (``cp_comm_s``)."""

from __future__ import annotations

import json

import pytest

from hacrl_megatron.cli import main as hacrl
from hacrl_megatron.config import load_config
from hacrl_megatron.plan.gpus import gpu_by_name
from hacrl_megatron.plan.known_models import KNOWN_CONFIGS
from hacrl_megatron.plan.memory import FUSED_WORKSPACE_BYTES, Layout, Workload, head_bytes, trainer_memory
from hacrl_megatron.plan.params import arch_from_config
from hacrl_megatron.plan.timing import Assumptions, Tokens, cp_ring_seconds, train_seconds

H100 = 74.5
SPEC = arch_from_config(KNOWN_CONFIGS["Llama-3.1-70B"])
WORK = Workload(seq_len=32768, micro_batch=1, microbatches=8)
TOKENS = Tokens(prompts=64, samples=1, agents=1, prompt_len=8192, max_response_len=24576, updates=1, micro_batch=1)


def _layout(cp: int, dp: int = 1, **kw) -> Layout:
    return Layout(8, 4, dp, True, kw.pop("recompute", "selective"), True, cp=cp, **kw)


def test_layout_counts_context_parallel_ranks():
    lay = _layout(cp=2, dp=2)
    assert (lay.gpus, lay.replicas) == (8 * 4 * 2 * 2, 4)
    assert Layout(2, 1, 1, ep=8, etp=1, cp=4).expert_dp == 1  # experts over tp·cp·dp = 8 ranks
    with pytest.raises(ValueError, match="must divide tp·cp·dp"):
        Layout(2, 1, 1, ep=16, etp=1, cp=4)
    assert (lay.rank_tokens(32768), lay.rank_tokens(32769), _layout(cp=1).rank_tokens(4097)) == (16384, 16386, 4097)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activations_and_sharded_optimizer_divide_by_cp(recompute):
    one = trainer_memory(SPEC, _layout(1, recompute=recompute), WORK)
    two = trainer_memory(SPEC, _layout(2, recompute=recompute), WORK)
    for a, b in zip(one, two):
        assert (b.weights, b.grads) == (a.weights, a.grads)  # CP replicates the weights like DP
        assert b.optimizer == pytest.approx(a.optimizer / 2)  # sharded over dp·cp
    # every per-token term halves: the layers' activations exactly; on the last stage the log-prob head
    # keeps its bounded backward slice (FUSED_WORKSPACE_BYTES) whatever the tokens
    assert two[0].activations == pytest.approx(one[0].activations / 2, rel=1e-9)
    heads = [head_bytes(SPEC, lay, WORK, WORK.logprob_path(lay)) for lay in (_layout(1, recompute=recompute),
                                                                           _layout(2, recompute=recompute))]
    assert two[-1].activations - heads[1] == pytest.approx((one[-1].activations - heads[0]) / 2, rel=1e-9)
    assert heads[1] - FUSED_WORKSPACE_BYTES == pytest.approx((heads[0] - FUSED_WORKSPACE_BYTES) / 2, rel=1e-9)


def test_ring_exchange_is_a_time_term():
    gpu, a = gpu_by_name("h100"), Assumptions()
    one, two = (train_seconds(SPEC, _layout(cp), gpu, TOKENS, a) for cp in (1, 2))
    assert one["cp_comm_s"] == 0.0 and two["cp_comm_s"] > 0
    assert two["train_compute_s"] == pytest.approx(one["train_compute_s"] / 2)
    assert two["tp_comm_s"] == pytest.approx(one["tp_comm_s"] / 2)
    tokens = TOKENS.trained_sequences * TOKENS.mean_seq(a)
    # forward + backward (K, V and their gradients: twice the forward) under selective recompute
    assert two["cp_comm_s"] == pytest.approx(3 * cp_ring_seconds(SPEC, _layout(2), gpu, tokens, a))
    ring = tokens / 2 * 80 / 4 * (2 * 8 * 128 / 8 * 2) * 1 / (gpu.network_gbps * 1e9 * a.link_efficiency)
    assert cp_ring_seconds(SPEC, _layout(2), gpu, tokens, a) == pytest.approx(ring)  # tp·cp = 16: off the node


def test_cli_cp(capsys, tmp_path):
    folder = tmp_path / "Llama-3.1-70B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(KNOWN_CONFIGS["Llama-3.1-70B"]))
    common = ["--model", str(folder), "--tp", "8", "--pp", "4", "--dp", "1", "--sequence-parallel",
              "--seq-len", "32768", "--recompute", "selective", "--gpu-memory-gib", f"{H100}", "--json"]
    out = {}
    for cp in (1, 2):
        assert hacrl(["plan", *common, "--cp", str(cp)]) == 0
        out[cp] = json.loads(capsys.readouterr().out)["agents"][0]
    assert out[2]["layout"]["cp"] == 2 and out[1]["layout"]["cp"] == 1
    assert not out[1]["fits"] and out[2]["fits"]  # 32k tokens fit a 70B TP8·PP4 only with cp = 2
    assert out[2]["time_s"]["cp_comm_s"] > 0
    assert hacrl(["plan", *common, "--cp", "0"]) == 2
    assert "--model needs --cp >= 1 (got 0)" in capsys.readouterr().err


def test_a_preset_agent_keeps_its_cp(monkeypatch):
    """The search keeps an agent's parallel.cp (dp = GPUs / (tp·pp·cp)) and its overrides say it; the
    planned config validates (on a machine with Transformer Engine: monkeypatched here)."""
    from argparse import Namespace

    from hacrl_megatron.plan.cli import _experiment

    monkeypatch.setattr("hacrl_megatron.models.provider.use_transformer_engine", lambda: True)
    overrides = ["agents.0.parallel.cp=2", "agents.0.workers=ray"]
    args = Namespace(preset="paper_qwen3_4b_with_instruct", overrides=overrides, nodes=1, gpus_per_node=8,
                     gpu_memory_gib=H100, gpu="h100")
    plan = _experiment(args)
    lay = plan["agents"][0]["layout"]
    assert lay["cp"] == 2 and lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"] == plan["agents"][0]["gpus"]["trainer"]
    assert plan["agents"][1]["layout"]["cp"] == 1
    assert "agents.0.parallel.cp=2" in plan["overrides"]
    cfg = load_config("paper_qwen3_4b_with_instruct", overrides + plan["overrides"])
    assert cfg.agents[0].parallel.world_size == plan["agents"][0]["gpus"]["trainer"]
