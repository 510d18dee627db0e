"""The planner on MoE agents: the GPU preset is its own plan, EP layouts are searched, the experts'
optimizer state is sharded over the expert-data-parallel group, and routing replay excludes full
recompute across pipeline stages."""

from __future__ import annotations

from argparse import Namespace

import pytest

from hacrl_megatron.config import load_config
from hacrl_megatron.plan.gpus import GPUS
from hacrl_megatron.plan.known_models import KNOWN_CONFIGS
from hacrl_megatron.plan.memory import GIB, Layout, Workload, trainer_memory
from hacrl_megatron.plan.params import arch_from_config, stage_param_split
from hacrl_megatron.plan.search import Cluster, ep_options, layouts, pp_options

H100 = 74.5
PRESET = "gpu_qwen3_30b_a3b_llama8b"


def test_moe_gpu_preset_is_what_the_planner_proposes():
    from hacrl_megatron.plan.cli import _experiment

    args = Namespace(preset=PRESET, overrides=[], nodes=3, gpus_per_node=8, gpu_memory_gib=H100, gpu="h100")
    plan = _experiment(args)
    assert all(a["fits"] for a in plan["agents"])
    moe = plan["agents"][0]
    assert moe["layout"]["ep"] * moe["layout"]["etp"] > 1 and moe["layout"]["sequence_parallel"]
    assert moe["params"]["hf_total"] == 30_532_122_624
    preset = load_config(PRESET)
    assert load_config(PRESET, plan["overrides"]).to_dict() == preset.to_dict()
    assert preset.agents[0].model.moe_routing_replay and preset.agents[0].parallel.recompute != "full"


def _qwen30b():
    return arch_from_config(KNOWN_CONFIGS["Qwen3-30B-A3B"])


def test_expert_layouts_and_uneven_pipelines_are_searched():
    spec = _qwen30b()
    assert ep_options(spec, 4, 4) == [(1, 4), (2, 1), (4, 1), (8, 1), (16, 1)]
    assert ep_options(arch_from_config(KNOWN_CONFIGS["Llama-3.1-8B-Instruct"]), 4, 4) == [(1, 1)]
    assert 4 in pp_options(arch_from_config(KNOWN_CONFIGS["Qwen3-235B-A22B"]))  # 94 layers: 23/24/24/23
    cluster = Cluster(nodes=2, gpus_per_node=8, gpu_memory_gib=H100, gpu=GPUS["h100"])
    found = layouts(spec, 16, cluster)
    assert {(lay.ep, lay.etp) for lay in found} >= {(1, 1), (2, 1), (8, 1), (16, 1)}
    replay = layouts(spec, 16, cluster, routing_replay=True)
    assert not any(lay.recompute == "full" and lay.pp > 1 for lay in replay)
    assert any(lay.recompute == "full" and lay.pp == 1 for lay in replay)


def test_expert_optimizer_state_is_sharded_over_expert_data_parallel():
    """TP4 · DP8 = 32 ranks: at EP8 the experts' fp32 master + Adam (12 B/param) are sharded over
    EDP = 4, the rest over DP = 8; the weights and main gradients are per rank."""
    spec = _qwen30b()
    work = Workload(seq_len=4096, micro_batch=1, microbatches=8)
    (stage,) = trainer_memory(spec, Layout(4, 1, 8, True, "full", True, ep=8, etp=1), work)
    ((dense, experts),) = stage_param_split(spec, 4, 1, ep=8)
    assert stage.params == dense + experts
    assert stage.weights == 2 * (dense + experts) and stage.grads == 4 * (dense + experts)
    assert stage.optimizer == pytest.approx(12 * dense / 8 + 12 * experts / 4)
    assert experts == 48 * 16 * 3 * 2048 * 768  # 16 of the 128 experts per EP rank, whole (ETP 1)
    with pytest.raises(ValueError, match="ep·etp = 16·1 must divide tp·dp = 4·2"):
        Layout(4, 1, 2, True, "full", True, ep=16)
    assert stage.total / GIB < H100


def test_plan_model_with_an_expert_layout(tmp_path, capsys):
    import json

    from hacrl_megatron.cli import main as hacrl

    for name in ("Qwen3-30B-A3B", "Llama-3.1-8B-Instruct"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(KNOWN_CONFIGS[name]))
    common = ["--tp", "4", "--pp", "4", "--dp", "2", "--sequence-parallel", "--gpu-memory-gib", str(H100)]
    assert hacrl(["plan", "--model", str(tmp_path / "Qwen3-30B-A3B"), "--ep", "8", *common, "--json"]) == 0
    (agent,) = json.loads(capsys.readouterr().out)["agents"]
    assert agent["params_per_stage"] == [1_043_581_952, 965_790_720, 965_790_720, 1_043_584_000]
    assert (agent["layout"]["ep"], agent["layout"]["etp"]) == (8, 1)
    assert hacrl(["plan", "--model", str(tmp_path / "Llama-3.1-8B-Instruct"), "--ep", "2", *common]) == 2
    assert "--ep/--etp need a Mixture-of-Experts model" in capsys.readouterr().err
