"""Context parallelism's split of a micro-batch over CP ranks (agents/context_parallel.py), exactly, on CPU.

* The positions of a row: megatron-core's own split (``get_batch_on_this_cp_rank``) for a right-padded
  row, Transformer Engine's ``thd_get_partitioned_indices`` (its CUDA kernel's index formula, written
  out here) for a packed row's padded slots; over the CP ranks every position exactly once.
* Real micro-batches, as LocalAgent cuts them (``plan_micro_batches_of`` and ``pad_rows``), for random
  lengths, cp ∈ {2, 4}, padded or packed (THD) rows, with and without sequence parallelism (tp = 2): each
  rank's tokens are the global tokens at its positions, its local row divides over the TP ranks, and the
  scored rows of all ranks together cover every response token exactly once, each at the local column of
  its predicting position; scattering each rank's values to ``token_index`` / ``seq_index`` and adding
  over ranks (what the CP all-reduce does) rebuilds the full micro-batch's vectors in its order.
* A rank that holds no predicting position of a micro-batch scores one stand-in row.
"""

from __future__ import annotations

import random

import pytest
import torch

from hacrl_megatron.agents.batch import SequenceBatch
from hacrl_megatron.agents.context_parallel import local_positions, scored_rows_on_rank, split_micro_batch
from hacrl_megatron.agents.packing import count_micro_batches, geometry_for, plan_micro_batches
from hacrl_megatron.agents.schedule import pad_rows, plan_micro_batches_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _te_partitioned_indices(cu_padded: list[int], total: int, cp: int, rank: int) -> list[int]:
    """Transformer Engine's ``thd_partition_indices_kernel``, one token at a time: local token j of
    sequence i (local slot length L/cp) is global ``start_i + j + offset · L/(2cp)`` with offset r in the
    first half, 2cp − 2 − r in the second."""
    local = [c // cp for c in cu_padded]
    out = []
    for token in range(total // cp):
        seq = max(i for i in range(len(local) - 1) if local[i] <= token)
        seq_len = local[seq + 1] - local[seq]
        index = token - local[seq]
        offset = rank if index < seq_len // 2 else (cp - 1) * 2 - rank
        out.append(index + local[seq] * cp + offset * seq_len // 2)
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_a_padded_row_splits_as_megatron_does(cp, monkeypatch):
    import inspect

    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_batch_on_this_cp_rank

    # 0.16 reads the CP size and rank from parallel_state; 0.19 from the group it is given (and needs
    # is_hybrid_cp, a cu_seqlens key of None for one sequence per row)
    takes_group = "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters
    length = 2 * cp * 5
    row = torch.arange(length).view(1, -1) * 10 + 7
    seen = []
    for rank in range(cp):
        monkeypatch.setattr(mpu, "get_context_parallel_world_size", lambda: cp)
        monkeypatch.setattr(mpu, "get_context_parallel_rank", lambda r=rank: r)
        if takes_group:
            monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: cp)
            monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=rank: r)
            theirs = get_batch_on_this_cp_rank({"tokens": row.clone(), "cu_seqlens": None}, False,
                                               cp_group=object())["tokens"]
        else:
            theirs = get_batch_on_this_cp_rank({"tokens": row.clone()})["tokens"]
        positions = local_positions(length, cp, rank)
        assert torch.equal(row[:, positions], theirs)
        seen += positions.tolist()
    assert sorted(seen) == list(range(length))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cp", [2, 4])
def test_a_packed_row_splits_as_transformer_engine_does(cp, seed):
    rng = random.Random(seed)
    slots = [2 * cp * rng.randint(1, 4) for _ in range(rng.randint(1, 5))]
    cu = [sum(slots[:i]) for i in range(len(slots) + 1)]
    seen = []
    for rank in range(cp):
        positions = local_positions(cu[-1], cp, rank, cu).tolist()
        assert positions == _te_partitioned_indices(cu, cu[-1], cp, rank)
        seen += positions
    assert sorted(seen) == list(range(cu[-1]))


def test_a_slot_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="does not split into 2·cp = 4 chunks"):
        local_positions(12, 2, 0, [0, 6, 12])
    with pytest.raises(ValueError, match="from 0 to the row length"):
        local_positions(12, 2, 0, [0, 8])


def _batch(rng: random.Random, n: int) -> SequenceBatch:
    lens = [rng.randint(2, 23) for _ in range(n)]
    ids = tuple(torch.randint(1, 90, (k,), generator=torch.Generator().manual_seed(rng.randint(0, 9999))) for k in lens)
    return SequenceBatch(input_ids=ids, prompt_lens=torch.tensor([rng.randint(1, k - 1) for k in lens]))


def _micro_batches(batch: SequenceBatch, packed: bool, tp: int, sp: bool, cp: int, budget: int) -> list:
    """The micro-batches of DP rank 0, as ``LocalAgent._split`` forms them before the CP split."""
    geometry = geometry_for(packed, tp, sp, cp)
    lengths = [int(ids.numel()) for ids in batch.input_ids]
    plan = (plan_micro_batches(lengths, 1, max(budget, geometry.tokens([max(lengths)])), geometry) if budget
            else count_micro_batches(len(batch), 3, 1))
    micro = plan_micro_batches_of(batch, plan, 0, geometry, thd=packed)  # packed: THD's PackedSeqParams
    return [pad_rows(mb, geometry.row_multiple) for mb in micro]


CASES = [(packed, sp, budget) for packed, sp, budget in
         [(False, False, 0), (False, False, 40), (False, True, 0), (False, True, 40), (True, False, 64),
          (True, True, 64)]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("packed, sp, budget", CASES)
def test_micro_batches_split_over_cp_ranks_cover_every_token_once(packed, sp, budget, cp, seed):
    rng = random.Random(1000 * cp + seed)
    tp = 2 if sp else 1
    for mb in _micro_batches(_batch(rng, rng.randint(1, 9)), packed, tp, sp, cp, budget):
        b, length = mb.tokens.shape
        n, s = mb.targets.numel(), mb.seq_len.numel()
        # stand-in per-position values: what a rank computes at (row, global position); the full vectors
        value = (mb.rows * 1000 + mb.cols).double()
        seq_of_token = torch.repeat_interleave(torch.arange(s), mb.seq_len)
        full_sums = torch.zeros(s, dtype=torch.double).index_add(0, seq_of_token, value)
        tokens_sum, sums_sum, covered, positions_seen = torch.zeros(n).double(), torch.zeros(s).double(), [], []
        for rank in range(cp):
            local = split_micro_batch(mb, cp, rank, group=None)
            split = local.context_parallel
            assert local.tokens.shape == (b, length // cp) and split.row_len == length and local.row_len == length
            assert (length // cp) % tp == 0  # sequence parallelism splits the local row again over tp
            assert torch.equal(local.tokens, mb.tokens[:, split.positions])
            assert torch.equal(local.position_ids, mb.position_ids[:, split.positions])
            positions_seen += split.positions.tolist()
            sc = split.scored
            if sc.stand_in:
                assert sc.token_index.numel() == 0 and sc.rows.tolist() == [0] and sc.cols.tolist() == [0]
                continue
            idx = sc.token_index
            assert torch.equal(idx, torch.sort(idx).values)  # global order kept
            assert torch.equal(split.positions[sc.cols], mb.cols[idx]) and torch.equal(sc.rows, mb.rows[idx])
            assert torch.equal(sc.targets, mb.targets[idx]) and bool((sc.cols < length // cp).all())
            assert int(sc.cu_seqlens[-1]) == idx.numel() and bool((sc.seq_len > 0).all())
            assert torch.equal(seq_of_token[idx], torch.repeat_interleave(sc.seq_index, sc.seq_len))
            local_value = (sc.rows * 1000 + split.positions[sc.cols]).double()  # computed on the local row
            tokens_sum += torch.zeros(n).double().index_copy(0, idx, local_value)
            local_sums = torch.segment_reduce(local_value, "sum", lengths=sc.seq_len)
            sums_sum += torch.zeros(s).double().index_copy(0, sc.seq_index, local_sums)
            covered += idx.tolist()
        assert sorted(positions_seen) == list(range(length))
        assert sorted(covered) == list(range(n))  # every response token on exactly one rank
        assert torch.equal(tokens_sum, value) and torch.allclose(sums_sum, full_sums, rtol=0, atol=0)


def test_a_rank_without_response_tokens_scores_a_stand_in_row():
    # cp = 2, one row of 8: the only response token (position 7) is predicted by position 6, chunk 3: rank 0's
    batch = SequenceBatch(input_ids=(torch.arange(1, 9),), prompt_lens=torch.tensor([7]))
    (mb,) = _micro_batches(batch, packed=False, tp=1, sp=False, cp=2, budget=0)
    on_0 = scored_rows_on_rank(mb, local_positions(8, 2, 0), 8)
    on_1 = scored_rows_on_rank(mb, local_positions(8, 2, 1), 8)
    assert not on_0.stand_in and on_0.token_index.tolist() == [0] and on_0.cols.tolist() == [2]  # [0, 1, 6, 7]
    assert on_1.stand_in and on_1.seq_index.numel() == 0 and on_1.cu_seqlens.tolist() == [0, 1]


def test_an_explicit_mask_cannot_be_split():
    batch = SequenceBatch(input_ids=(torch.arange(1, 9),), prompt_lens=torch.tensor([3]))
    geometry = geometry_for(True, 1, False, 2)
    (mb,) = plan_micro_batches_of(batch, count_micro_batches(1, 1, 1), 0, geometry, thd=False)
    with pytest.raises(ValueError, match="Transformer Engine's attention"):
        split_micro_batch(mb, 2, 0, group=None)
