"""A context-parallel LocalAgent (cp = 2) against the cp = 1 agent on the same weights, on 2 GPUs (NCCL).

Skipped without two CUDA devices and Transformer Engine (context parallelism runs inside TE's
attention). Run on a GPU machine with ``python -m pytest tests/gpu/test_context_parallel_gpu.py -q``.

One spawned 2-process world; megatron's parallel state is rebuilt for each agent: cp = 2 (dp = 1, each
row split over both GPUs, padded rows and packed THD rows) and the reference cp = 1 (dp = 2: the
same full-batch gradient, summed over data-parallel ranks instead). Same HF weights (bf16: TE's fused
and flash attention, the backends with context parallelism, need 16-bit inputs), same HACPO batch.
Compared: per-token log-probs and per-sequence sums of the no-grad pass, then one update's loss,
gradient norm and every parameter's reduced fp32 main gradient.

Tolerances (bf16 weights and activations; the ring computes attention in per-chunk blocks merged by
their log-sum-exp, so the sums run in another order): token log-probs 5e-2 absolute (a bf16 ulp of
logits of order 10 is 6e-2), sums, loss and gradient norm 2e-2 relative, gradients 3e-2 of the largest.
A gradient counted cp times would be off by 100 %.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")


def _has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
    pytest.mark.skipif(not _has_transformer_engine(), reason="needs transformer_engine (context parallelism)"),
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]
TEMPERATURE = 0.7
LENS, PROMPTS = (37, 20, 61, 9, 44, 28, 53, 15), (11, 4, 30, 2, 17, 20, 9, 7)


def _save_model(path: str) -> None:
    import transformers

    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
    cfg.architectures = ["LlamaForCausalLM"]
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def _run(hf_dir: str, cp: int, dp: int, packed: bool) -> dict:
    from megatron.core import parallel_state as mpu

    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.config import AgentConfig, ModelConfig, ParallelConfig, TrainConfig
    from tests.distributed.megatron_helpers import hacpo_batch, hacpo_loss

    cfg = AgentConfig(name="a", workers="ray", lr=1e-3, model=ModelConfig(arch="llama", hf_path=hf_dir, dtype="bfloat16"),
                      parallel=ParallelConfig(tp=1, pp=1, dp=dp, cp=cp))
    train = TrainConfig(micro_batch_size=4, grad_clip=0.0, max_tokens_per_microbatch=160 if packed else 0,
                        pack_sequences=packed)
    agent = LocalAgent(cfg, train)
    batch = hacpo_batch(lens=LENS, prompts=PROMPTS)
    lp = agent.token_logprobs(batch, temperature=TEMPERATURE)
    (metrics,) = agent.train([batch], hacpo_loss(), temperature=TEMPERATURE)
    out = {"info": (agent.info.cp, agent.info.cp_rank, agent.info.dp), "tok": lp.token_logps.float(),
           "sums": lp.seq_logp_sum.float(), "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
           "grads": {n: p.main_grad.detach().float().cpu() for n, p in agent.module.named_parameters()}}
    del agent
    torch.cuda.synchronize()
    mpu.destroy_model_parallel()
    return out


def _compare(ref: dict, run: dict) -> dict:
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    return {"info": list(run["info"]),
            "token_err": float((run["tok"] - ref["tok"]).abs().max()),
            "sum_rel_err": float(((run["sums"] - ref["sums"]).abs() / ref["sums"].abs()).max()),
            "loss_rel_err": abs(run["loss"] - ref["loss"]) / abs(ref["loss"]),
            "grad_norm_rel_err": abs(run["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"],
            "grad_err": max(float((run["grads"][k] - ref["grads"][k]).abs().max()) for k in ref["grads"]) / scale}


def _world(rank: int, hf_dir: str) -> dict:
    ref = _run(hf_dir, cp=1, dp=2, packed=False)
    return {"padded": _compare(ref, _run(hf_dir, cp=2, dp=1, packed=False)),
            "packed": _compare(ref, _run(hf_dir, cp=2, dp=1, packed=True))}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tests.distributed.megatron_helpers import run_world

    root = tmp_path_factory.mktemp("cp_gpu")
    _save_model(os.path.join(root, "llama"))
    out = run_world(_world, 2, (os.path.join(root, "llama"),), str(root))
    print("cp=2 against cp=1 on 2 GPUs:", out)  # the measured errors (pytest -s)
    return out


@pytest.mark.parametrize("rows", ["padded", "packed"])
def test_context_parallel_agent_equals_the_cp1_agent(world, rows):
    res = world[rows]
    assert res["info"] == [2, 0, 1], res  # rank 0: cp=2, cp_rank 0, dp 1
    assert res["token_err"] <= 5e-2 and res["sum_rel_err"] <= 2e-2, res
    assert res["loss_rel_err"] <= 2e-2 and res["grad_norm_rel_err"] <= 2e-2, res
    assert res["grad_err"] <= 3e-2, res
