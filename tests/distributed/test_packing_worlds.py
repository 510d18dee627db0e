"""Token budgets and packed sequences on 2-rank Megatron gloo worlds: TP2 with sequence parallelism,
PP2, and DP2 (where one rank also runs a filler micro-batch); one spawned world, megatron's parallel
state rebuilt for each layout.

In each world the same HACPO mini-batch is cut three ways (``micro_batch_size`` sequences padded, a
token budget with padded rows, the budget with packed rows); per-token log-probs, per-sequence sums,
the HACPO loss and every gradient must equal the padded cut's. Tolerances as tests/unit/test_packing.py
states them (float32, reassociated sums): token log-probs 2e-6 absolute, sums and losses 1e-5
relative, gradients 1e-5 of the largest gradient. Under sequence parallelism every row is padded to
a multiple of TP, packed rows included, and the padding never reaches a real token.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from tests.distributed.megatron_helpers import (  # noqa: E402
    agent_config,
    hacpo_batch,
    hacpo_loss,
    make_tiny_hf,
    run_world,
    train_config,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]

# tp, pp, dp, sequence_parallel, distributed optimizer
# (DP2 without the distributed optimizer: its main_grad holds the reduced gradient everywhere, not a shard)
LAYOUTS = {"tp2sp": (2, 1, 1, True, False), "pp2": (1, 2, 1, False, False), "dp2": (1, 1, 2, False, False)}
CUTS = {"padded": dict(micro_batch_size=3), "budget": dict(max_tokens_per_microbatch=24),
        "packed": dict(max_tokens_per_microbatch=24, pack_sequences=True)}
# DP2, three sequences of 19, 15 and 12 tokens and a budget of 19: one rank takes 19 and 12 (two
# micro-batches, they cannot share a padded row of 19), the other 15 alone -> it runs a filler
FILLER_SELECT, FILLER_BUDGET = [2, 7, 4], 19


def _gather_grads(agent) -> dict[str, torch.Tensor]:
    """This rank's gradient of each parameter (its TP/PP shard), keyed by name and rank."""
    rank = torch.distributed.get_rank()
    return {f"{rank}:{n}": p.main_grad.clone() for n, p in agent.module.named_parameters()}


def _cut(layout: str, hf_dir: str, train_kw: dict, select: list[int] | None = None) -> dict:
    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.config import ParallelConfig

    tp, pp, dp, sp, dist_opt = LAYOUTS[layout]
    cfg = agent_config("llama", hf_dir, tp, pp, dp, lr=1e-3, dist_opt=dist_opt)
    cfg.parallel = ParallelConfig(tp=tp, pp=pp, dp=dp, sequence_parallel=sp, use_distributed_optimizer=dist_opt)
    agent = LocalAgent(cfg, train_config(grad_clip=0.0, **train_kw))
    batch = hacpo_batch() if select is None else hacpo_batch().select(select)
    tok = agent.token_logprobs(batch, temperature=0.7)
    (metrics,) = agent.train([batch], hacpo_loss())
    grads = _gather_grads(agent)
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, grads)
    plan = agent._plan(batch)
    return dict(token_logps=tok.token_logps, seq_logp_sum=tok.seq_logp_sum, loss=metrics["loss"],
                grads={k: v for part in gathered for k, v in part.items()},
                pad_fraction=agent.stats()["pad_fraction"], fillers=sum(sum(f) for f in plan.fillers))


def _compare(ref: dict, other: dict) -> dict:
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    return dict(
        token_err=float((other["token_logps"] - ref["token_logps"]).abs().max()),
        sum_rel_err=float(((other["seq_logp_sum"] - ref["seq_logp_sum"]).abs() / ref["seq_logp_sum"].abs()).max()),
        loss_rel_err=abs(other["loss"] - ref["loss"]) / abs(ref["loss"]),
        grad_rel_err=max(float((other["grads"][k] - ref["grads"][k]).abs().max()) for k in ref["grads"]) / scale,
        same_grad_keys=set(other["grads"]) == set(ref["grads"]),
    )


def _layout(layout: str, hf_dir: str) -> dict:
    runs = {name: _cut(layout, hf_dir, kw) for name, kw in CUTS.items()}
    out = {name: _compare(runs["padded"], run) for name, run in runs.items() if name != "padded"}
    out["pad_fraction"] = {name: run["pad_fraction"] for name, run in runs.items()}
    out["fillers"] = {name: run["fillers"] for name, run in runs.items()}
    if layout == "dp2":
        three = _cut(layout, hf_dir, CUTS["padded"], FILLER_SELECT)
        filler = _cut(layout, hf_dir, dict(max_tokens_per_microbatch=FILLER_BUDGET), FILLER_SELECT)
        out["filler"] = _compare(three, filler)
        out["fillers"]["filler"] = filler["fillers"]
    return out


def _world(rank: int, hf_dir: str) -> dict:
    """Every layout in one 2-process world (megatron's parallel state rebuilt between them: a world
    costs seconds of imports to spawn)."""
    from megatron.core import parallel_state as mpu

    out = {}
    for layout in LAYOUTS:
        out[layout] = _layout(layout, hf_dir)
        mpu.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("packing worlds")
    make_tiny_hf("llama", str(path / "llama"), seed=6)
    return str(path / "llama")


@pytest.fixture(scope="module")
def worlds(hf_dir, tmp_path_factory):
    return run_world(_world, 2, (hf_dir,), str(tmp_path_factory.mktemp("world")))


@pytest.fixture(params=sorted(LAYOUTS))
def world(request, worlds):
    return request.param, worlds[request.param]


def test_budget_and_packed_cuts_equal_the_padded_one(world):
    layout, res = world
    for name in ("budget", "packed"):
        err = res[name]
        assert err["same_grad_keys"], (layout, name)
        assert err["token_err"] <= 2e-6, (layout, name, err)
        assert err["sum_rel_err"] <= 1e-5 and err["loss_rel_err"] <= 1e-5, (layout, name, err)
        assert err["grad_rel_err"] <= 1e-5, (layout, name, err)
    pads = res["pad_fraction"]
    assert pads["packed"] <= pads["budget"] < pads["padded"]
    if layout != "tp2sp":  # under SP the packed row is padded to a multiple of TP
        assert pads["packed"] == 0.0


def test_a_dp_rank_short_of_sequences_runs_a_filler_that_changes_nothing(worlds):
    res = worlds["dp2"]
    assert res["fillers"]["filler"] >= 1 and res["fillers"]["budget"] == 0
    err = res["filler"]
    assert err["token_err"] <= 2e-6 and err["sum_rel_err"] <= 1e-5 and err["loss_rel_err"] <= 1e-5, err
    assert err["grad_rel_err"] <= 1e-5, err
