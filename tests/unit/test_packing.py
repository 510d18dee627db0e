"""Token-budget micro-batches and packed sequences (agents/packing.py, agents/schedule.py, agents/padding.py).

The plan is checked exactly on hand cases and by its invariants on random ones; the packed row's mask,
positions and loss positions exactly; and the three ways to cut a mini-batch (``micro_batch_size``
sequences padded, a token budget padded, a token budget packed) against each other on the HF backend
and on the Megatron agent in this process, with HACPO's loss.

Tolerances: everything runs in float32 on CPU. Packed and padded rows are different GEMM shapes and
attention spans, so sums are reassociated: per-token log-probs agree to 2e-6 absolute (a few ulps of
values of order 5), gradients to 1e-5 relative to the largest gradient. Sequence sums and losses add
the same numbers in another order: 1e-5 relative.
"""

from __future__ import annotations

import random

import pytest
import torch

from hacrl_megatron.agents.packing import Geometry, count_micro_batches, geometry_for, plan_micro_batches
from hacrl_megatron.agents.padding import pack_row
from hacrl_megatron.config import ConfigError, load_config

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

CUTS = {"padded": dict(micro_batch_size=3), "budget": dict(max_tokens_per_microbatch=24),
        "packed": dict(max_tokens_per_microbatch=24, pack_sequences=True)}


# ---- the plan -------------------------------------------------------------------------------------
def _plan(lengths, dp, budget, packed, row_multiple=1):
    return plan_micro_batches(lengths, dp, budget, Geometry(packed=packed, row_multiple=row_multiple))


def test_plan_by_hand_packed_and_padded():
    # deal longest first to the least-loaded rank with room (rooms 3, 2): r0 = 10, 3, 2; r1 = 8, 7
    assert _plan([10, 3, 7, 2, 8], 2, 12, packed=True).ranks == (((0, 3), (1,)), ((4,), (2,)))
    # padded rows cost B·T_max: 10 + 3 would be 2·10 = 20 > 12, so 3 and 2 share a row (2·3 = 6)
    assert _plan([10, 3, 7, 2, 8], 2, 12, packed=False).ranks == (((0,), (1, 3)), ((4,), (2,)))


def test_a_rank_with_fewer_micro_batches_splits_its_costliest():
    # r0 = 20 | 4 + 4 (two micro-batches), r1 = 4 + 4 fits one: it is split so both ranks run two
    plan = _plan([4, 4, 4, 4, 20], 2, 20, packed=True)
    assert plan.ranks == (((4,), (2, 3)), ((0,), (1,)))
    assert plan.fillers == ((False, False), (False, False))


def test_a_rank_out_of_sequences_gets_a_filler_that_repeats_its_shortest():
    plan = _plan([5, 5, 5], 2, 5, packed=False)
    assert plan.ranks == (((0,), (2,)), ((1,), (1,)))
    assert plan.fillers == ((False, False), (False, True))
    assert plan.rank_indices(1) == [1]
    assert plan.tokens([5, 5, 5], Geometry()) == (15, 20)  # the filler's tokens are padding


@pytest.mark.parametrize("seed", range(40))
def test_plan_invariants_on_random_batches(seed):
    rng = random.Random(seed)
    n, dp = rng.randint(1, 40), rng.randint(1, 4)
    if n < dp:
        n = dp
    lengths = [max(2, int(rng.lognormvariate(3.0, 0.8))) for _ in range(n)]
    geometry = Geometry(packed=rng.random() < 0.5, row_multiple=rng.choice([1, 2, 4]))
    budget = rng.randint(geometry.tokens([max(lengths)]), 4 * geometry.tokens([max(lengths)]))
    plan = plan_micro_batches(lengths, dp, budget, geometry)
    seen = sorted(i for r in range(dp) for i in plan.rank_indices(r))
    assert seen == list(range(n)), "every sequence in exactly one real micro-batch"
    assert len({len(rank) for rank in plan.ranks}) == 1, "every rank runs the same number of micro-batches"
    counts = [len(plan.rank_indices(r)) for r in range(dp)]
    assert max(counts) - min(counts) <= 1
    for rank, fills in zip(plan.ranks, plan.fillers):
        for mb, fill in zip(rank, fills):
            assert mb and (len(mb) == 1 or geometry.tokens([lengths[i] for i in mb]) <= budget)
            assert not fill or len(mb) == 1
        assert not any(fills) or all(len(mb) == 1 for mb, f in zip(rank, fills) if not f), \
            "a filler only where no micro-batch of the rank could be split"


def test_count_plan_is_the_contiguous_split_of_before():
    assert count_micro_batches(7, 2, 2).ranks == (((0, 1), (2, 3)), ((4, 5), (6,)))
    with pytest.raises(ValueError, match="cannot be split over data-parallel size 3"):
        count_micro_batches(2, 2, 3)


def test_geometry_counts_the_tokens_a_layout_runs():
    assert Geometry().tokens([5, 3]) == 10
    assert Geometry(packed=True).tokens([5, 3]) == 8
    assert geometry_for(True, 2, True).tokens([5, 3]) == 8
    assert geometry_for(True, 2, True).tokens([5, 2]) == 8  # 7 rounded up to the tp multiple
    assert geometry_for(False, 2, True).tokens([5, 3]) == 12  # 2 rows of 6
    assert geometry_for(True, 2, True, cp=2).tokens([5, 3]) == 16  # each sequence to a multiple of 2·cp·tp
    assert geometry_for(False, 1, False, cp=2).tokens([5]) == 8


# ---- the packed row -------------------------------------------------------------------------------
def test_packed_micro_batch_by_hand():
    from hacrl_megatron.agents.batch import SequenceBatch
    from hacrl_megatron.agents.schedule import make_packed_micro_batch

    batch = SequenceBatch(input_ids=(torch.tensor([11, 12, 13]), torch.tensor([21, 22])), prompt_lens=torch.tensor([1, 1]))
    mb = make_packed_micro_batch(batch, seq_index=[4, 2], geometry=Geometry(packed=True, row_multiple=3))
    assert mb.tokens.tolist() == [[11, 12, 13, 21, 22, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]  # the tail pad continues the last slot
    assert mb.cols.tolist() == [0, 1, 3] and mb.rows.tolist() == [0, 0, 0]
    assert mb.targets.tolist() == [12, 13, 22] and mb.seq_index.tolist() == [4, 2] and mb.real_tokens == 5
    blocked = mb.attention_mask[0, 0].int().tolist()
    assert blocked == [[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1],
                       [1, 1, 1, 0, 1, 1], [1, 1, 1, 0, 0, 1], [1, 1, 1, 0, 0, 0]]


def test_hf_pack_row_by_hand():
    from hacrl_megatron.agents.batch import SequenceBatch

    batch = SequenceBatch(input_ids=(torch.tensor([1, 2]), torch.tensor([3, 4, 5])), prompt_lens=torch.tensor([1, 2]))
    ids, pos, mask, starts = pack_row(batch)
    assert ids.tolist() == [[1, 2, 3, 4, 5]] and pos.tolist() == [[0, 1, 0, 1, 2]] and starts.tolist() == [0, 2]
    assert (mask[0, 0] == 0).int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0],
                                                [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


# ---- equality with the padded path ----------------------------------------------------------------
def _assert_same(ref, other, name):
    tok_ref, loss_ref, grads_ref = ref
    tok, loss, grads = other
    assert torch.allclose(tok.token_logps, tok_ref.token_logps, rtol=0, atol=2e-6), name
    assert torch.allclose(tok.seq_logp_sum, tok_ref.seq_logp_sum, rtol=1e-5, atol=0), name
    assert loss == pytest.approx(loss_ref, rel=1e-5), name
    scale = max(float(g.abs().max()) for g in grads_ref.values())
    worst = max(float((grads[k] - grads_ref[k]).abs().max()) for k in grads_ref)
    assert worst <= 1e-5 * scale, f"{name}: gradients differ by {worst} (largest {scale})"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.distributed.megatron_helpers import make_tiny_hf

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("packing")
    make_tiny_hf("qwen2", str(root / "qwen2"), seed=5)
    make_tiny_hf("llama", str(root / "llama"), seed=6)
    return root


def _hf_run(path, train_kw):
    import transformers

    from hacrl_megatron.agents.hf import HFAgent
    from hacrl_megatron.config import TrainConfig
    from tests.distributed.megatron_helpers import hacpo_batch, hacpo_loss

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    agent = HFAgent("a", model, lr=1e-3, train_cfg=TrainConfig(grad_clip=0.0, **train_kw))
    batch = hacpo_batch()
    tok = agent.token_logprobs(batch, temperature=0.7)
    (metrics,) = agent.train([batch], hacpo_loss())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (tok, metrics["loss"], grads), agent.stats()["pad_fraction"]


def test_hf_backend_budget_and_packed_equal_padded(tiny):
    runs = {name: _hf_run(str(tiny / "qwen2"), kw) for name, kw in CUTS.items()}
    for name in ("budget", "packed"):
        _assert_same(runs["padded"][0], runs[name][0], name)
    pads = {name: pad for name, (_, pad) in runs.items()}
    assert pads["packed"] == 0.0 < pads["budget"] < pads["padded"]


def _megatron_run(path, train_kw, monkeypatch=None):
    from hacrl_megatron.agents.local import LocalAgent
    from tests.distributed.megatron_helpers import agent_config, hacpo_batch, hacpo_loss, train_config

    agent = LocalAgent(agent_config("llama", path, lr=1e-3), train_config(grad_clip=0.0, **train_kw))
    batch = hacpo_batch()
    tok = agent.token_logprobs(batch, temperature=0.7)
    (metrics,) = agent.train([batch], hacpo_loss())
    grads = {n: p.main_grad.clone() for n, p in agent.module.named_parameters()}
    return (tok, metrics["loss"], grads), agent.stats()["pad_fraction"]


def test_megatron_budget_and_packed_equal_padded(tiny):
    pytest.importorskip("megatron.core")
    runs = {name: _megatron_run(str(tiny / "llama"), kw) for name, kw in CUTS.items()}
    for name in ("budget", "packed"):
        _assert_same(runs["padded"][0], runs[name][0], name)
    assert runs["packed"][1] == 0.0 < runs["budget"][1] < runs["padded"][1]


def test_packed_rope_positions_restart_per_sequence(tiny):
    """Every packed sequence gets RoPE frequencies from position 0 on. (Attention under RoPE depends on
    relative positions only, so an offset would change the log-probs by rounding alone, not visibly:
    the frequencies the model receives are checked instead. Restarting keeps positions within the
    model's own range, where low-precision angles stay accurate.)"""
    pytest.importorskip("megatron.core")
    from hacrl_megatron.agents.local import LocalAgent
    from tests.distributed.megatron_helpers import agent_config, hacpo_batch, train_config

    agent = LocalAgent(agent_config("llama", str(tiny / "llama")), train_config(**CUTS["packed"]))
    rope = agent.module.rotary_pos_emb
    plain = rope(64)[:, 0, 0]  # [64, dim]: the frequencies of positions 0..63
    seen = []
    handle = rope.register_forward_hook(lambda module, args, out: seen.append(out))
    batch = hacpo_batch()
    try:
        agent.token_logprobs(batch)
    finally:
        handle.remove()
    rows = agent._split(batch)
    assert len(seen) == len(rows) and any(len(mb.seq_len) > 1 for mb in rows), "rows of several sequences"
    for freqs, mb in zip(seen, rows):
        assert torch.equal(freqs[:, 0, 0], plain[mb.position_ids[0]]), "each token gets its sequence's position"
        starts = (mb.position_ids[0] == 0).sum()
        assert starts == len(mb.seq_len), "positions restart at every sequence"


def test_hf_packed_rows_hand_the_model_restarting_positions(tiny):
    import transformers

    from hacrl_megatron.agents.hf import HFAgent
    from hacrl_megatron.config import TrainConfig
    from tests.distributed.megatron_helpers import hacpo_batch

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny / "qwen2"), dtype=torch.float32)
    agent = HFAgent("a", model, lr=1e-3, train_cfg=TrainConfig(**CUTS["packed"]))
    seen = []
    handle = model.model.rotary_emb.register_forward_hook(lambda module, args, out: seen.append(args[1]))
    batch = hacpo_batch()
    try:
        agent.token_logprobs(batch)
    finally:
        handle.remove()
    groups = agent._micro_batches(batch)
    assert [p.tolist() for p in seen] == [[[t for i in g for t in range(batch.input_ids[i].numel())]] for g in groups]


# ---- configuration --------------------------------------------------------------------------------
def test_packing_needs_a_budget_that_holds_the_longest_sequence():
    with pytest.raises(ConfigError, match=r"train\.pack_sequences.*set train\.max_tokens_per_microbatch"):
        load_config("cpu_demo", ["train.pack_sequences=true"])
    with pytest.raises(ConfigError, match=r"train\.max_tokens_per_microbatch=8: must hold the longest sequence"):
        load_config("cpu_demo", ["train.max_tokens_per_microbatch=8"])
    cfg = load_config("cpu_demo", ["train.max_tokens_per_microbatch=512", "train.pack_sequences=true"])
    assert cfg.train.max_tokens_per_microbatch == 512 and cfg.train.pack_sequences is True
