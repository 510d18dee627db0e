"""Vocabulary-parallel log-probs with 2 gloo processes equal the unsharded computation.

Rank r holds LM-head rows [r·V_local, (r+1)·V_local). Checked on every rank: token log-probs and
sequence sums (values), dH (all-reduced inside the backward) and this rank's dW rows, for the
plain kernel, Megatron-style vocab padding, and the fused HACPO loss; plus megatron-core's own
``vocab_parallel_cross_entropy`` at TP = 2 as a peer, and batch invariance under TP.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import pytest
import torch

pytestmark = pytest.mark.distributed

N, H, V_LOCAL = 30, 12, 23
LENS = [1, 7, 10, 12]


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64) * 0.7
    weight = torch.randn(2 * V_LOCAL, H, generator=g, dtype=torch.float64) * 0.7
    targets = torch.randint(0, 2 * V_LOCAL, (N,), generator=g)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])
    return hidden, weight, targets, cu


def _err(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max())


def _compare_plain(rank, group, vocab_size, temperature):
    from hacrl_megatron.kernels import sequence_logprobs

    hidden, weight, targets, cu = _inputs()
    if vocab_size is not None:
        targets = targets % vocab_size
    up = torch.linspace(-1.0, 1.0, N, dtype=torch.float64)
    h_full, w_full = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    full = sequence_logprobs(h_full, w_full, targets, cu, temperature=temperature, impl="reference",
                             vocab_size=vocab_size)
    g_full = torch.autograd.grad((full.token_logps * up).sum() + full.seq_logp_sum.sum(), (h_full, w_full))
    rows = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    h_tp, w_tp = hidden.clone().requires_grad_(True), weight[rows].clone().requires_grad_(True)
    tp = sequence_logprobs(h_tp, w_tp, targets, cu, temperature=temperature, tp_group=group, impl="reference",
                           chunk_size=4, vocab_size=vocab_size)
    g_tp = torch.autograd.grad((tp.token_logps * up).sum() + tp.seq_logp_sum.sum(), (h_tp, w_tp))
    return {"logp": _err(tp.token_logps, full.token_logps), "sum": _err(tp.seq_logp_sum, full.seq_logp_sum),
            "dh": _err(g_tp[0], g_full[0]), "dw": _err(g_tp[1], g_full[1][rows])}


def _compare_fused(rank, group):
    from hacrl_megatron.algo import LossInputs
    from hacrl_megatron.config import HACPOConfig
    from hacrl_megatron.kernels import fused_hacpo_loss, sequence_logprobs

    hidden, weight, targets, cu = _inputs()
    with torch.no_grad():
        base = sequence_logprobs(hidden, weight, targets, cu).seq_logp_sum
    lens = torch.tensor(LENS, dtype=torch.float64)
    src_len = torch.tensor([2, 7, 9, 12])
    inputs = LossInputs(
        source_logp_sum=(base / lens - torch.tensor([0.0, -0.1, 0.05, -0.15], dtype=torch.float64)) * src_len,
        source_len=src_len, advantages=torch.tensor([0.5, 1.0, -0.7, 0.9], dtype=torch.float64),
        is_self=torch.tensor([True, False, False, False]),
        discrepancy=torch.tensor([1.0, 2.0, 0.5, 1.2], dtype=torch.float64))
    seq = dict(inputs=inputs, update_index=1, cfg=HACPOConfig(alpha=2.0), num_sequences=5)
    rows = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    h_full, w_full = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    l_full, _ = fused_hacpo_loss(h_full, w_full, targets, cu, impl="reference", **seq)
    g_full = torch.autograd.grad(l_full, (h_full, w_full))
    h_tp, w_tp = hidden.clone().requires_grad_(True), weight[rows].clone().requires_grad_(True)
    l_tp, _ = fused_hacpo_loss(h_tp, w_tp, targets, cu, impl="reference", tp_group=group, chunk_size=3, **seq)
    g_tp = torch.autograd.grad(l_tp, (h_tp, w_tp))
    return {"loss": _err(l_tp, l_full), "dh": _err(g_tp[0], g_full[0]), "dw": _err(g_tp[1], g_full[1][rows]),
            "grad_scale": float(g_full[0].abs().max())}


def _invariance(rank, group):
    from hacrl_megatron.kernels import sequence_logprobs

    hidden, weight, targets, cu = _inputs()
    w = weight[rank * V_LOCAL:(rank + 1) * V_LOCAL].float()
    full = sequence_logprobs(hidden.float(), w, targets, cu, tp_group=group, chunk_size=8).token_logps
    a, b = LENS[0] + LENS[1], N
    alone = sequence_logprobs(hidden[a:b].float(), w, targets[a:b], torch.tensor([0, b - a]), tp_group=group,
                              chunk_size=8).token_logps
    return bool(torch.equal(alone, full[a:b]))


def _megatron_peer(rank):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from hacrl_megatron.kernels import sequence_logprobs

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group = parallel_state.get_tensor_model_parallel_group()
    hidden, weight, targets, cu = _inputs()
    w = weight[rank * V_LOCAL:(rank + 1) * V_LOCAL].float()
    ours = sequence_logprobs(hidden.float(), w, targets, cu, tp_group=group, impl="reference").token_logps
    local_logits = (hidden.float() @ w.t()).view(N, 1, V_LOCAL)
    theirs = -vocab_parallel_cross_entropy(local_logits.clone(), targets.view(N, 1)).view(N)
    parallel_state.destroy_model_parallel()
    return _err(ours, theirs)


def _worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    result = {
        "plain": _compare_plain(rank, group, None, 1.0),
        "plain_t07": _compare_plain(rank, group, None, 0.7),
        # 40 real ids over 46 rows: rank 1 holds 17 real rows and 6 padding rows
        "padded": _compare_plain(rank, group, 2 * V_LOCAL - 6, 1.0),
        "fused": _compare_fused(rank, group),
        "invariant": _invariance(rank, group),
        "megatron": _megatron_peer(rank),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), tmp), nprocs=2, join=True)
        out = []
        for rank in range(2):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                out.append(json.load(f))
    return out


@pytest.mark.parametrize("case", ["plain", "plain_t07", "padded"])
def test_sharded_vocab_equals_unsharded(results, case):
    for rank, r in enumerate(results):
        assert max(r[case].values()) < 1e-12, (rank, r[case])


def test_fused_hacpo_loss_under_tp_equals_unsharded(results):
    for rank, r in enumerate(results):
        assert r["fused"]["grad_scale"] > 1e-3
        assert max(r["fused"]["loss"], r["fused"]["dh"], r["fused"]["dw"]) < 1e-12, (rank, r["fused"])


def test_batch_invariant_under_tp(results):
    assert all(r["invariant"] for r in results)


def test_matches_megatron_vocab_parallel_cross_entropy_at_tp2(results):
    for rank, r in enumerate(results):
        assert r["megatron"] < 2e-5, (rank, r["megatron"])
