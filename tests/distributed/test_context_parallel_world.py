"""Context parallelism's combine on gloo worlds (agents/context_parallel.py), through megatron's own
schedule, DDP and ``finalize_model_grads`` with ``context_parallel_size=2``: 2 ranks (cp = 2), and 4
ranks with TP2 and sequence parallelism (each CP rank's row split again over its TP ranks, the scored
rows gathered over TP, the LM head's vocabulary split over TP).

megatron-core's parallel state is initialised by ``init_parallel(cp=2)`` (gloo, CPU): the CP group, the
data-parallel × context-parallel group DDP reduces over, ``ParallelInfo.cp`` / ``cp_rank``. The local
(CPU) attention refuses cp > 1, so the model is a stand-in without attention: each output position's
hidden state is ``tanh(E[token] + P[position])`` and the LM head a weight W, scored by our fused
kernel's reference backend, exactly as ``LocalAgent`` scores (``run_schedule``'s loss function, the
``LMHead``); under sequence parallelism each TP rank returns its slice of the rank's row, as megatron's
last stage does, and the stand-in's embedding tables are marked ``sequence_parallel`` (their gradients
summed over TP by ``finalize_model_grads``, like the norms'). Every rank runs its chunks of every row (``split_for_context_parallel``) and assembles the
full log-probs; the single-process evaluation of the full rows is the reference, on each rank.

Compared, for padded rows (``micro_batch_size``), a token budget with padded rows and one with packed
THD rows (``PackedSeqParams``; per-sequence split): per-token log-probs and per-sequence sums of the
no-grad pass, and one backward of HACPO's loss plus a token-level term (so gradients reach the token
log-probs too) — the loss and, after DDP's SUM over the dp×cp group, every parameter's gradient.

Tolerances: a token's log-prob is computed from the same hidden row by the same kernel on one rank
and moved by an all-reduce that adds zeros: equal to 1e-6 (measured: exact at TP1; 4.8e-7 at TP2,
whose vocabulary-parallel log-sum-exp adds the two shards in another order than the whole
vocabulary's). A sequence's sum adds two ranks' partial sums instead of one run of tokens: 1e-5
relative (measured 1.1e-7); the loss 1e-5 relative; gradients (each rank's share summed by DDP and,
under TP, the embedding tables' over TP, in another order than the one-process backward) 1e-5 of the
largest gradient (measured 7.6e-7). A wrong backward (summing instead of identity) doubles every
gradient.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.distributed.megatron_helpers import VOCAB, hacpo_batch, hacpo_loss, run_world  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]
CP, HIDDEN, TEMPERATURE = 2, 16, 0.7
CUTS = {"padded": (False, 0), "budget": (False, 24), "packed": (True, 32)}  # packed, token budget
PADDED_VOCAB = VOCAB + 1  # at TP2 megatron pads the odd vocabulary to a multiple of 2


class StandIn(torch.nn.Module):
    """hidden[b, t] = tanh(E[token] + P[position]) [B, T, H]: every output row a differentiable function
    of its own token and position only (no attention), with the LM head W [V, H] of the fused path."""

    def __init__(self, config, tp: int = 1, tp_rank: int = 0) -> None:
        from megatron.core.enums import ModelType

        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.config, self.tp, self.tp_rank = config, tp, tp_rank
        self.model_type = ModelType.encoder_or_decoder
        self.embedding = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g) * 0.5)
        self.position = torch.nn.Parameter(torch.randn(64, HIDDEN, generator=g) * 0.5)
        head = torch.randn(PADDED_VOCAB, HIDDEN, generator=g) * 0.3  # this TP rank's vocabulary rows
        shard = PADDED_VOCAB // tp if tp > 1 else VOCAB
        self.head = torch.nn.Parameter(head[tp_rank * shard : (tp_rank + 1) * shard].clone())
        for table in (self.embedding, self.position):  # replicated over TP, used on each rank's slice
            table.sequence_parallel = tp > 1

    def set_input_tensor(self, tensor) -> None:  # megatron's schedule calls it (no pipeline here)
        pass

    def forward(self, tokens, position_ids, attention_mask=None, packed_seq_params=None):
        hidden = torch.tanh(self.embedding[tokens] + self.position[position_ids])  # [B, T, H]
        if self.tp == 1:
            return hidden
        shard = hidden.shape[1] // self.tp  # sequence parallelism: this TP rank's slice of the row
        return hidden[:, self.tp_rank * shard : (self.tp_rank + 1) * shard]


def _config(tp: int):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=tp, context_parallel_size=CP,
                             tensor_model_parallel_size=tp, sequence_parallel=tp > 1, cp_comm_type="p2p",
                             calculate_per_token_loss=True, variable_seq_lengths=True, use_cpu_initialization=True,
                             moe_token_dispatcher_type="alltoall", gradient_accumulation_fusion=False)


def _loss_fn():
    """HACPO's sequence-level loss plus a token-level term: a LossFn that reads both outputs."""
    hacpo = hacpo_loss()

    def loss(lp, inputs, info):
        value, metrics = hacpo(lp, inputs, info)
        weights = torch.linspace(-1.0, 1.0, lp.token_logps.numel(), dtype=lp.token_logps.dtype)
        return value + 0.1 * (weights * lp.token_logps).sum() / info.num_tokens, metrics

    return loss


def _micro_batches(batch, packed: bool, budget: int, tp: int):
    from hacrl_megatron.agents.packing import count_micro_batches, geometry_for, plan_micro_batches
    from hacrl_megatron.agents.schedule import pad_rows, plan_micro_batches_of

    geometry = geometry_for(packed, tp, tp > 1, CP)
    lengths = [int(ids.numel()) for ids in batch.input_ids]
    plan = plan_micro_batches(lengths, 1, budget, geometry) if budget else count_micro_batches(len(batch), 3, 1)
    micro = plan_micro_batches_of(batch, plan, 0, geometry, thd=packed)
    return [pad_rows(mb, geometry.row_multiple) for mb in micro]


def _reference(micro, loss_fn, info, tp: int, tp_rank: int):
    """One process, full rows, the whole vocabulary: token log-probs [N_total], sums [S_total]
    (micro-batch order), loss, and the gradients of this TP rank's parameters (its head rows)."""
    from hacrl_megatron.agents.lm_head import LMHead, response_logprobs
    from hacrl_megatron.agents.logprob_path import logprob_path

    model = StandIn(_config(1))
    full = torch.nn.Parameter(torch.cat([StandIn(_config(1), tp, r).head.detach() for r in range(tp)]))
    head = LMHead(logprob_path("reference", False), VOCAB, weight=lambda: full)
    tokens, sums, loss = [], [], 0.0
    for mb in micro:
        lp = response_logprobs(model(mb.tokens, mb.position_ids), mb, TEMPERATURE, head)
        loss = loss + loss_fn(lp, mb.loss_inputs, info)[0]
        tokens.append(lp.token_logps.detach())
        sums.append(lp.seq_logp_sum.detach())
    d_embedding, d_position, d_head = torch.autograd.grad(loss, [model.embedding, model.position, full])
    shard = d_head.shape[0] // tp
    grads = [d_embedding, d_position, d_head[tp_rank * shard : (tp_rank + 1) * shard]]
    return torch.cat(tokens), torch.cat(sums), float(loss), [g.detach() for g in grads]


def _context_parallel(ddp, head, micro, loss_fn, info, rank):
    """The same through megatron's schedule with each rank's chunks: forward-only log-probs, then one
    backward; DDP's main_grad after finalize_model_grads (the dp×cp SUM)."""
    from hacrl_megatron.agents.context_parallel import split_for_context_parallel
    from hacrl_megatron.agents.schedule import run_schedule

    split = split_for_context_parallel(micro, CP, rank)
    tokens, sums, losses = [], [], []

    def collect(lp, mb):
        tokens.append(lp.token_logps.detach())
        sums.append(lp.seq_logp_sum.detach())
        return lp.seq_logp_sum.sum() * 0

    run_schedule(ddp, split, collect, TEMPERATURE, head, forward_only=True)

    def step_loss(lp, mb):
        value = loss_fn(lp, mb.loss_inputs, info)[0]
        losses.append(float(value.detach()))
        return value

    ddp.zero_grad_buffer()
    run_schedule(ddp, split, step_loss, TEMPERATURE, head, forward_only=False)
    grads = [p.main_grad.detach().clone() for p in ddp.module.parameters()]
    stand_ins = sum(int(mb.context_parallel.scored.stand_in) for mb in split)
    return torch.cat(tokens), torch.cat(sums), sum(losses), grads, stand_ins


def _world(rank: int, tp: int) -> dict:
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from hacrl_megatron.agents.lm_head import LMHead
    from hacrl_megatron.agents.local import _finalize_grads
    from hacrl_megatron.agents.logprob_path import logprob_path
    from hacrl_megatron.models.parallel import init_parallel

    info_ = init_parallel(tp, 1, 1, backend="gloo", cp=CP)
    out: dict = {"info": [info_.tp, info_.cp, info_.cp_rank, info_.dp, info_.world_size],
                 "dp_cp_group": torch.distributed.get_world_size(mpu.get_data_parallel_group(with_context_parallel=True))}
    model = StandIn(_config(tp), tp, info_.tp_rank)
    model.config.finalize_model_grads_func = _finalize_grads  # LocalAgent's: megatron's, without 1/num_tokens
    ddp = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  module=model)
    path = logprob_path("reference", tp > 1)  # gather_rows under sequence parallelism
    head = LMHead(path, VOCAB, weight=lambda: model.head, tp_group=mpu.get_tensor_model_parallel_group() if tp > 1 else None)
    out["gather_rows"] = path.gather_rows
    batch, loss_fn = hacpo_batch(), _loss_fn()
    info = batch.info(0)
    for cut, (packed, budget) in CUTS.items():
        micro = _micro_batches(batch, packed, budget, tp)
        ref_tok, ref_sum, ref_loss, ref_grads = _reference(micro, loss_fn, info, tp, info_.tp_rank)
        tok, sums, loss, grads, stand_ins = _context_parallel(ddp, head, micro, loss_fn, info, info_.cp_rank)
        scale = max(float(g.abs().max()) for g in ref_grads)
        out[cut] = {
            "token_err": float((tok - ref_tok).abs().max()),
            "sum_rel_err": float(((sums - ref_sum).abs() / ref_sum.abs()).max()),
            "loss": (loss, ref_loss),
            "grad_err": max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)) / scale,
            "grad_ratio": [float(g.norm() / r.norm()) for g, r in zip(grads, ref_grads)],
            "micro_batches": len(micro), "stand_ins": stand_ins,
            "thd": all(mb.packed_seq_params is not None for mb in micro) if packed else False,
        }
    return out


# the 4-rank world (TP2 with sequence parallelism × CP2) runs in the slow step, as the other 4-rank worlds
@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)], ids=["cp2", "tp2sp_cp2"])
def world(request, tmp_path_factory):
    torch.set_num_threads(1)
    tp = request.param
    out = run_world(_world, tp * CP, (tp,), str(tmp_path_factory.mktemp("cp_world")))
    print(f"context parallel (tp={tp}, cp=2) against one process:", out)  # the measured errors (pytest -s)
    return out


def test_parallel_state_has_a_context_parallel_group(world):
    tp = world["info"][0]
    assert world["info"] == [tp, 2, 0, 1, 2 * tp]  # rank 0's view: tp, cp=2, cp_rank 0, dp 1, world tp·cp
    assert world["dp_cp_group"] == 2  # DDP reduces over data parallel × context parallel
    assert world["gather_rows"] == (tp > 1)  # under SP the scored rows are gathered from the CP-local row


@pytest.mark.parametrize("cut", CUTS)
def test_token_logprobs_and_sums_equal_the_full_rows(world, cut):
    res = world[cut]
    assert res["token_err"] <= 1e-6 and res["sum_rel_err"] <= 1e-5, res
    assert res["thd"] == (cut == "packed"), res


@pytest.mark.parametrize("cut", CUTS)
def test_loss_and_summed_gradients_equal_the_full_rows(world, cut):
    res = world[cut]
    loss, ref = res["loss"]
    assert loss == pytest.approx(ref, rel=1e-5), res
    assert res["grad_err"] <= 1e-5, res
    assert all(abs(r - 1) < 1e-5 for r in res["grad_ratio"]), res  # not scaled by cp (a summing backward: 2.0)
