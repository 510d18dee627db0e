"""Trainer offload (agents/offload.py, ``rollout.colocate_offload``) on CPU: the state a sleep parks and a
wake brings back is bit-identical (every optimizer state tensor, main param, grad buffer and model
param, for megatron-core's FP32, mixed-precision and distributed optimizers and for the HF agent's
AdamW), the storages really are given up while asleep, an update after a wake equals the update
without a sleep (two agents with the same weights, exactly), and calls that would read parked state
raise instead of reading freed memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from hacrl_megatron.agents.hf import HFAgent  # noqa: E402
from hacrl_megatron.agents.local import LocalAgent  # noqa: E402
from hacrl_megatron.agents.offload import AgentAsleep  # noqa: E402
from tests.distributed.megatron_helpers import (  # noqa: E402
    agent_config,
    sample_batch,
    sft_loss,
    tiny_hf_config,
    train_config,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

# (distributed optimizer, dtype): megatron's FP32Optimizer, DistributedOptimizer (fp32: its shards are
# views of the DDP parameter buffer; bf16: fp32 main weights of its own), Float16OptimizerWithFloat16Params
LAYOUTS = [(False, "float32"), (True, "float32"), (True, "bfloat16"), (False, "bfloat16")]


def local_agent(dist: bool, dtype: str, seed: int = 3) -> LocalAgent:
    cfg = agent_config("qwen3", None, lr=3e-3, dist_opt=dist)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
    return LocalAgent(cfg, train_config(micro_batch_size=2, seed=seed), vocab_size=97)


def megatron_state(agent: LocalAgent) -> dict[str, torch.Tensor]:
    """Every tensor of the agent's training state, by what it is, cloned."""
    out: dict[str, torch.Tensor] = {}
    for name, p in agent.module.named_parameters():
        out[f"param/{name}"] = p
        out[f"main_grad/{name}"] = p.main_grad
    for k, buffer in enumerate(agent.model.buffers):
        out[f"grad_buffer/{k}"] = buffer.grad_data
        if buffer.param_data is not None:
            out[f"param_buffer/{k}"] = buffer.param_data
    for c, part in enumerate(agent.optimizer.chained_optimizers):
        for g, group in enumerate(part.optimizer.param_groups):
            for i, main in enumerate(group["params"]):
                out[f"main_param/{c}/{g}/{i}"] = main
                for key, value in part.optimizer.state[main].items():
                    if isinstance(value, torch.Tensor):
                        out[f"optimizer_state/{c}/{g}/{i}/{key}"] = value
    return {k: v.detach().clone() for k, v in out.items()}


def assert_identical(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert value.dtype == after[key].dtype and torch.equal(value, after[key]), key


@pytest.mark.parametrize("dist, dtype", LAYOUTS)
def test_sleep_and_wake_restore_every_tensor_bit_identically(dist, dtype):
    agent = local_agent(dist, dtype)
    agent.train([sample_batch(seed=4)], sft_loss)  # Adam's state exists and the grad buffers hold gradients
    before = megatron_state(agent)
    kinds = {key.split("/")[0] for key in before}
    assert {"param", "main_grad", "grad_buffer", "main_param", "optimizer_state"} <= kinds
    params = dict(agent.module.named_parameters())
    agent.sleep("optimizer")
    assert agent.asleep == "optimizer"
    assert all(p.untyped_storage().nbytes() > 0 for p in params.values())  # the weights stay for the export
    assert all(buffer.grad_data.untyped_storage().nbytes() == 0 for buffer in agent.model.buffers)
    state = [v for part in agent.optimizer.chained_optimizers for s in part.optimizer.state.values()
             for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    assert state and all(v.untyped_storage().nbytes() == 0 for v in state)
    agent.sleep("all")
    assert all(p.untyped_storage().nbytes() == 0 for p in params.values())
    assert agent.stats()["offload_mib"] > 0
    agent.wake()
    assert agent.asleep == "none"
    assert dict(agent.module.named_parameters()) == params  # the same tensor objects, their views intact
    grad_buffers = {buffer.grad_data.untyped_storage()._cdata for buffer in agent.model.buffers}
    assert all(p.main_grad.untyped_storage()._cdata in grad_buffers for p in params.values())  # still views
    assert_identical(before, megatron_state(agent))


@pytest.mark.parametrize("dist, dtype", LAYOUTS)
def test_an_update_after_a_wake_equals_one_without_offload(dist, dtype):
    slept, plain = local_agent(dist, dtype), local_agent(dist, dtype)
    plain.module.load_state_dict(slept.module.state_dict())
    for agent in (slept, plain):
        agent.train([sample_batch(seed=4)], sft_loss)
    slept.sleep("optimizer")  # the schedule's two stages: before the sync, then before the engines' KV cache
    slept.sleep("all")
    slept.wake()
    batch = sample_batch(seed=7)
    (a,), (b,) = slept.train([batch], sft_loss), plain.train([batch], sft_loss)
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert_identical(megatron_state(plain), megatron_state(slept))
    exported = dict(plain.export_hf_weights())
    for name, tensor in slept.export_hf_weights():
        assert torch.equal(tensor, exported[name]), name


def test_calls_that_read_parked_state_raise_instead_of_reading_freed_memory():
    agent = local_agent(False, "float32")
    agent.train([sample_batch(seed=4)], sft_loss)
    probe = sample_batch(seed=5)
    awake_sums, _ = agent.sequence_logprobs(probe)
    agent.sleep("optimizer")  # the post-sync probe: a no-grad forward with the optimizer asleep
    assert torch.equal(agent.sequence_logprobs(probe)[0], awake_sums)
    with pytest.raises(AgentAsleep, match=r"train\(\) needs the agent fully awake.*level 'optimizer'"):
        agent.train([probe], sft_loss)
    for call in (agent.save, agent.begin_save, agent.load):  # the checkpoint mixin's entry points too
        with pytest.raises(AgentAsleep, match=rf"{call.__name__}\(\)"):
            call("/nonexistent")
    agent.sleep("all")
    for call in (lambda: agent.sequence_logprobs(probe), agent.export_hf_weights, agent.keep_reference):
        with pytest.raises(AgentAsleep, match="needs the agent its weights awake.*level 'all'"):
            call()
    agent.wake()
    assert torch.equal(agent.sequence_logprobs(probe)[0], awake_sums)
    agent.sleep("none")  # colocate_offload=none: nothing moves
    assert agent.asleep == "none"
    with pytest.raises(ValueError, match="offload level 'everything'"):
        agent.sleep("everything")


@pytest.mark.parametrize("loaded", [False, True])
def test_hf_agent_sleeps_and_wakes_its_model_and_adamw_bit_identically(tmp_path, loaded):
    """``loaded``: the model comes from an HF folder as the trainer loads it (transformers memory-maps the
    weights: those storages cannot be resized and stay, file-backed; AdamW's state still goes)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama"), dtype=torch.float32)
    if loaded:
        model.save_pretrained(tmp_path)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    twin = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama"), dtype=torch.float32)
    twin.load_state_dict(model.state_dict())
    slept, plain = (HFAgent("hf", m, lr=1e-3, train_cfg=train_config(micro_batch_size=2)) for m in (model, twin))
    for agent in (slept, plain):
        agent.train([sample_batch(seed=4)], sft_loss)

    def state(agent: HFAgent) -> dict[str, torch.Tensor]:
        out = {f"param/{n}": p for n, p in agent.model.named_parameters()}
        for i, p in enumerate(agent.optimizer.param_groups[0]["params"]):
            out.update({f"adam/{i}/{k}": v for k, v in agent.optimizer.state[p].items()})
        return {k: v.detach().clone() for k, v in out.items()}

    before = state(slept)
    slept.sleep("optimizer")
    assert all(v.untyped_storage().nbytes() == 0 for s in slept.optimizer.state.values() for k, v in s.items()
               if k != "step")
    slept.sleep("all")
    assert all((p.untyped_storage().nbytes() == 0) != (loaded and not p.untyped_storage().resizable())
               for p in slept.model.parameters())
    slept.wake()
    assert_identical(before, state(slept))
    batch = sample_batch(seed=7)
    assert slept.train([batch], sft_loss)[0]["loss"] == plain.train([batch], sft_loss)[0]["loss"]
    assert_identical(state(plain), state(slept))


def test_an_moe_agent_with_its_chained_dense_and_expert_optimizers_sleeps_and_wakes(tmp_path):
    """An MoE agent's optimizer chains a dense and an expert optimizer (agents/local.py), and its DDP
    keeps the experts' gradients in buffers of their own: all of it parks and comes back bit-identically."""
    from hacrl_megatron.config import AgentConfig, ModelConfig, ParallelConfig
    from tests.distributed.moe_helpers import make_tiny_moe

    make_tiny_moe("qwen3_moe", str(tmp_path / "moe"), seed=2)
    agent = LocalAgent(AgentConfig(name="moe", model=ModelConfig(arch="qwen3_moe", hf_path=str(tmp_path / "moe")),
                                   lr=1e-3, parallel=ParallelConfig()), train_config(micro_batch_size=2))
    assert len(agent.optimizer.chained_optimizers) == 2
    agent.train([sample_batch(seed=4)], sft_loss)
    before = megatron_state(agent)
    expert_grads = [b.grad_data for b in agent.model.expert_parallel_buffers]
    saved = [g.clone() for g in expert_grads]
    assert expert_grads and any(float(g.abs().sum()) > 0 for g in saved)
    agent.sleep("all")
    assert all(g.untyped_storage().nbytes() == 0 for g in expert_grads)
    agent.wake()
    assert_identical(before, megatron_state(agent))
    assert all(torch.equal(a, b.grad_data) for a, b in zip(saved, agent.model.expert_parallel_buffers))
