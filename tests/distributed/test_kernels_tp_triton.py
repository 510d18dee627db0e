"""The Triton backend under tensor parallelism: 2 gloo ranks, kernels interpreted on CPU.

Rank r holds LM-head rows [r·V_local, (r+1)·V_local). Under the interpreter the kernel's vocab block
is 32 columns and its split 128, so the cases cover a slice that is a multiple of the block (64),
slices that are not (40: rank 0's last block holds rank 1's ids 40..63 as columns 40..63; 150: two
splits, the second 22 columns wide), and Megatron padding (74 real ids over 80 rows: rank 1 feeds
34 rows to the kernel). Targets cover every rank's range, the ids that fall in a rank's partly
empty last block, the split boundary, and the first and last ids. Each rank checks, for float32
and bfloat16 inputs, token log-probs, sequence sums, dH (all-reduced in the backward) and its own
dW rows against the float64 reference over the unsharded vocabulary of the same (rounded) inputs.

The ranks start with ``TRITON_INTERPRET=1`` in their environment (triton reads it when it is
imported) and check that the kernels really are interpreted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import warnings

import pytest

# find_spec, not importorskip: importing triton in the ranks before TRITON_INTERPRET is set would
# leave the kernels compiled-for-GPU (triton reads the variable when it is first imported)
pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]

N, H = 24, 12
LENS = [1, 5, 8, 10]
BLOCK_V = 32  # the interpreter's vocab block (triton_impl._config on CPU)
# name: (V_local, real vocab_size or None, dtype name)
CASES = {
    "v40_fp32": (40, None, "float32"),
    "v40_bf16": (40, None, "bfloat16"),
    "v64_fp32": (64, None, "float32"),
    "v64_bf16": (64, None, "bfloat16"),
    "v150_fp32": (150, None, "float32"),
    "v40_padded_fp32": (40, 74, "float32"),
    "v40_padded_bf16": (40, 74, "bfloat16"),
}


def _targets(v_local: int, vocab: int):
    """[N] global ids: both ranks' ranges, rank 0's tail block, the 128-split edge, first/last ids."""
    import torch

    tail_end = min(-(-v_local // BLOCK_V) * BLOCK_V, vocab)
    tail = list(range(v_local, tail_end))[:: max(1, (tail_end - v_local) // 8)][:8]
    picks = [0, v_local - 1, vocab - 1, min(127, vocab - 1), min(128, vocab - 1), *tail]
    rest = torch.randint(0, vocab, (N - len(picks),), generator=torch.Generator().manual_seed(3)).tolist()
    return torch.tensor(picks + rest)


def _case(rank: int, group, v_local: int, vocab_size: int | None, dtype_name: str) -> dict:
    import torch

    from hacrl_megatron.kernels import sequence_logprobs

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(v_local)
    vocab = vocab_size or 2 * v_local
    hidden = (torch.randn(N, H, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    weight = (torch.randn(2 * v_local, H, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    targets = _targets(v_local, vocab)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])
    up = torch.linspace(-1.0, 1.0, N, dtype=torch.float64)
    rows = slice(rank * v_local, (rank + 1) * v_local)

    h_ref = hidden.double().requires_grad_(True)
    w_ref = weight.double().requires_grad_(True)
    ref = sequence_logprobs(h_ref, w_ref, targets, cu, impl="reference", vocab_size=vocab_size)
    g_ref = torch.autograd.grad((ref.token_logps * up).sum() + ref.seq_logp_sum.sum(), (h_ref, w_ref))

    h_tp = hidden.clone().requires_grad_(True)
    w_tp = weight[rows].clone().requires_grad_(True)
    tp = sequence_logprobs(h_tp, w_tp, targets, cu, tp_group=group, impl="triton", chunk_size=16,
                           vocab_size=vocab_size)
    loss = (tp.token_logps.double() * up).sum() + tp.seq_logp_sum.double().sum()
    g_tp = torch.autograd.grad(loss, (h_tp, w_tp))

    def err(a, b):
        return float((a.detach().double() - b.detach().double()).abs().max())

    return {
        "finite": bool(torch.isfinite(tp.token_logps).all() and torch.isfinite(g_tp[0].float()).all()
                       and torch.isfinite(g_tp[1].float()).all()),
        "logp": err(tp.token_logps, ref.token_logps), "sum": err(tp.seq_logp_sum, ref.seq_logp_sum),
        "dh": err(g_tp[0], g_ref[0]), "dw": err(g_tp[1], g_ref[1][rows]),
        "grad_dtypes": [str(g_tp[0].dtype), str(g_tp[1].dtype)],
        "scale": float(g_ref[0].abs().max()),
        "tail_targets": int(((targets >= v_local) & (targets < -(-v_local // BLOCK_V) * BLOCK_V)).sum()),
    }


def _worker(rank: int, store: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from hacrl_megatron.kernels import triton_impl

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    kernel_kind = type(triton_impl._shard_stats_kernel).__name__
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    result = {"kernel_kind": kernel_kind}
    for name, (v_local, vocab_size, dtype_name) in CASES.items():
        result[name] = _case(rank, group, v_local, vocab_size, dtype_name)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp_env:
        mp_env.setenv("TRITON_INTERPRET", "1")  # inherited by the ranks before they import anything
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), tmp), nprocs=2, join=True)
        out = []
        for rank in range(2):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                out.append(json.load(f))
    return out


def test_kernels_are_interpreted(results):
    assert all(r["kernel_kind"] == "InterpretedFunction" for r in results), [r["kernel_kind"] for r in results]


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_under_tp_equals_unsharded_reference(results, case):
    v_local, vocab_size, dtype_name = CASES[case]
    # rank 0's last block holds ids of rank 1 exactly when its slice is not a multiple of the block
    assert (results[0][case]["tail_targets"] > 0) == (v_local % BLOCK_V != 0)
    for rank, r in enumerate(results[:2]):
        r = r[case]
        assert r["finite"], (rank, r)
        assert r["scale"] > 1e-2, (rank, r)
        # both paths accumulate in fp32 from the same rounded inputs: ~1e-6 apart (fp32 epsilon × |logit|)
        assert r["logp"] < 2e-5 and r["sum"] < 1e-4, (rank, r)
        expect = "torch.float32" if dtype_name == "float32" else "torch.bfloat16"
        assert r["grad_dtypes"] == [expect, expect], (rank, r)
        # bf16 gradients are rounded once to bf16 (relative 2**-8 of values below ~2)
        bound = 2e-5 if dtype_name == "float32" else 1.6e-2
        assert r["dh"] < bound and r["dw"] < bound, (rank, r)
