"""The fused log-prob kernel under TP2 · sequence parallelism equals megatron's logits path (2-rank gloo world).

Under sequence parallelism each TP rank's last stage holds [T/2, B, H] of the hidden states; the fused
path all-gathers only the scored rows and runs the vocab-parallel kernel (agents/lm_head.py). In one
world, for a tied (llama) and an untied (qwen2) tiny model, two agents from the same weights —
``logprob_impl="reference"`` (fused) and ``"megatron"`` (materialised logits) — score the same batch:

* per-token log-probs and per-sequence sums (no-grad pass) agree, and equal HF transformers;
* the gradients of every parameter shard (megatron's fp32 ``main_grad``, after the schedule's
  ``finalize_model_grads``, which also all-reduces the sequence-parallel norm weights) of one
  backward of HACPO's loss agree. A gradient wrong by the gather's backward (a reduce-scatter of the
  kernel's already all-reduced dH) would be exactly twice megatron's.

The batch's second micro-batch scores positions of rank 1 only (every prompt covers the first
half of the row): rank 0 contributes an all-padding block to the row gather.

Tolerances are a few float32 ulps of the compared magnitudes: token log-probs (|log π| < 8: ulp
4.8e-7) and gradients (|g| < 1) within 2e-6, per-sequence sums (|Σ| up to ~70: ulp 7.6e-6) within
2e-5. The paths form the same numbers by float32 reductions in different orders (the kernel's
chunked log-sum-exp and fp32 dH accumulator against megatron's softmax over [N, V/2] and the
output layer's GEMM, then a segment sum against an index_add), not by different terms.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from tests.distributed.megatron_helpers import (  # noqa: E402
    VOCAB,
    hacpo_batch,
    hacpo_loss,
    hf_token_logprobs,
    make_tiny_hf,
    run_world,
)

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]
ARCHS = ("llama", "qwen2")  # tied and untied LM head
TEMPERATURE = 0.7
TOL = 2e-6  # token log-probs, gradients
SUM_TOL = 2e-5  # per-sequence sums of up to 15 log-probs
# micro-batches of 4: the second one's prompts all end in the second half of its 16-token row
LENS, PROMPTS = (7, 5, 19, 6, 16, 12, 14, 15), (3, 2, 4, 1, 9, 9, 9, 9)


def _batch():
    return hacpo_batch(lens=LENS, prompts=PROMPTS)


def _agent(arch: str, root: str, impl: str):
    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.config import AgentConfig, ModelConfig, ParallelConfig, TrainConfig

    cfg = AgentConfig(name="a", model=ModelConfig(arch=arch, hf_path=os.path.join(root, arch)), lr=1e-3,
                      parallel=ParallelConfig(tp=2, pp=1, dp=1, sequence_parallel=True))
    return LocalAgent(cfg, TrainConfig(micro_batch_size=4), logprob_impl=impl)


def _grads(agent, batch) -> dict[str, torch.Tensor]:
    """This rank's fp32 main gradient of every parameter after one backward of HACPO's loss."""
    from hacrl_megatron.agents.schedule import run_schedule

    loss_fn, info = hacpo_loss(), batch.info(0)

    def step_loss(lp, mb):
        return loss_fn(lp, mb.loss_inputs, info)[0]

    agent.model.zero_grad_buffer()
    run_schedule(agent.model, agent._split(batch), step_loss, TEMPERATURE, agent.head, forward_only=False)
    return {n: p.main_grad.detach().clone() for n, p in agent.module.named_parameters()}


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t)


def _world(rank: int, root: str) -> dict:
    refs = torch.load(os.path.join(root, "hf_token_logprobs.pt"))
    batch, out = _batch(), {}
    for arch in ARCHS:
        agents = {impl: _agent(arch, root, impl) for impl in ("reference", "megatron")}
        fused, plain = agents["reference"], agents["megatron"]
        lp = {impl: a.token_logprobs(batch, temperature=TEMPERATURE) for impl, a in agents.items()}
        grads = {impl: _grads(a, batch) for impl, a in agents.items()}
        ratio = [float(g.norm() / grads["megatron"][n].norm()) for n, g in grads["reference"].items()
                 if grads["megatron"][n].norm() > 0]
        out[arch] = {
            "fused_path": (fused.head.path.name, fused.head.path.gather_rows, plain.head.path.name),
            "token_logprob_err": float((lp["reference"].token_logps - lp["megatron"].token_logps).abs().max()),
            "seq_sum_err": float((lp["reference"].seq_logp_sum - lp["megatron"].seq_logp_sum).abs().max()),
            "hf_err": float((lp["reference"].token_logps - refs[arch]).abs().max()),
            "grad_err": _max_over_ranks(max(float((g - grads["megatron"][n]).abs().max())
                                            for n, g in grads["reference"].items())),
            "grad_scale": _max_over_ranks(max(float(g.abs().max()) for g in grads["megatron"].values())),
            "grad_norm_ratio": (_max_over_ranks(max(ratio)), -_max_over_ranks(-min(ratio))),
        }
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("sp_logprobs")
    refs = {}
    for arch in ARCHS:
        hf = make_tiny_hf(arch, str(root / arch), seed=5)
        with torch.no_grad():
            refs[arch] = torch.cat(hf_token_logprobs(hf, _batch(), TEMPERATURE))
    torch.save(refs, root / "hf_token_logprobs.pt")
    out = run_world(_world, 2, (str(root),), str(root))
    print("fused vs megatron logits path, TP2·SP:", out)  # the measured errors (pytest -s)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_path_runs_under_sequence_parallelism(world, arch):
    assert tuple(world[arch]["fused_path"]) == ("fused", True, "megatron")


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_equal_megatron_logits_path(world, arch):
    res = world[arch]
    assert res["token_logprob_err"] <= TOL and res["seq_sum_err"] <= SUM_TOL, res
    assert res["hf_err"] <= 1e-5, res  # both paths agree with the model they were loaded from
    assert VOCAB % 2 == 1  # the vocabulary is padded at TP2: padding rows must stay out of both


@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_equal_megatron_logits_path(world, arch):
    res = world[arch]
    assert res["grad_scale"] > 1e-3, res  # the loss reaches the weights at all
    assert res["grad_err"] <= TOL, res
    lo, hi = res["grad_norm_ratio"]
    assert abs(lo - 1) < 1e-4 and abs(hi - 1) < 1e-4, res  # no shard is scaled (double-counted dH: 2.0)
