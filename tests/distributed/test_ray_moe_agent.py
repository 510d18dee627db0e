"""A MoE agent at DP2 · EP2 as Ray actors (gloo), built from an in-memory transformers model (fused
3-D expert tensors), against the EP = 1 LocalAgent: log-probs, updates with routing replay and the
router losses, the HF export (per-expert names), a checkpoint that loads at EP = 1."""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from hacrl_megatron.agents.ray_agent import build_ray_agent  # noqa: E402
from hacrl_megatron.config import AgentConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from tests.distributed.megatron_helpers import sample_batch, sft_loss, start_local_ray  # noqa: E402
from tests.distributed.moe_helpers import make_tiny_moe  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]
CPU = {"use_gpu": False, "env_vars": {"PYTHONWARNINGS": "ignore"}}


def _cfg(dp: int = 1, ep: int = 1) -> AgentConfig:
    model = ModelConfig(arch="qwen3_moe", moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.005, moe_routing_replay=True)
    return AgentConfig(name="moe", model=model, lr=1e-3, parallel=ParallelConfig(dp=dp, ep=ep))


def _steps(agent, batch, steps: int = 2) -> list[dict]:
    out = []
    for _ in range(steps):
        agent.token_logprobs(batch)  # the π_old pass records the routes
        out.append(agent.train([batch.select([3, 1, 0, 2])], sft_loss)[0])
    return out


def test_dp2_ep2_ray_agent_equals_the_ep1_local_agent(tmp_path):
    from hacrl_megatron.agents.local import LocalAgent

    start_local_ray()
    try:
        hf = make_tiny_moe("qwen3_moe", None, seed=12)
        batch = sample_batch(lens=(8, 6, 10, 6), prompts=(3, 2, 4, 1))
        local = LocalAgent.from_hf_model(_cfg(), hf, train_cfg=TrainConfig(micro_batch_size=2))
        ref_lp, _ = local.sequence_logprobs(batch)
        ref_metrics = _steps(local, batch)
        ref_weights = dict(local.export_hf_weights())
        agent = build_ray_agent(_cfg(dp=2, ep=2), hf, TrainConfig(micro_batch_size=2), None, **CPU)
        try:
            assert [i["ep_rank"] for i in agent.infos] == [0, 1]
            lp, _ = agent.sequence_logprobs(batch)
            torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
            for got, want in zip(_steps(agent, batch), ref_metrics):
                for key in ("loss", "grad_norm", "moe/aux_loss", "moe/z_loss"):
                    assert got[key] == pytest.approx(want[key], rel=1e-5), key
            weights = dict(agent.export_hf_weights())
            assert set(weights) == set(ref_weights) and "model.layers.0.mlp.experts.3.up_proj.weight" in weights
            assert max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights) <= 1e-5
            agent.save(str(tmp_path / "ck"))
        finally:
            agent.close()
        local.load(str(tmp_path / "ck"))  # written by the EP = 2 world
        assert local.updates == 2
        assert float((local.sequence_logprobs(batch)[0] - agent_lp_after(weights, hf, batch)).abs().max()) <= 1e-5
    finally:
        ray.shutdown()


def agent_lp_after(weights: dict, hf, batch) -> torch.Tensor:
    """Log-probs of the exported weights, through a fresh EP = 1 agent."""
    from hacrl_megatron.agents.local import LocalAgent

    fresh = LocalAgent(_cfg(), TrainConfig(micro_batch_size=2), hf_checkpoint=weights, hf_config=hf.config)
    return fresh.sequence_logprobs(batch)[0]
