"""The Triton kernels compiled for CUDA against the torch reference (skipped without a GPU).

Run on a GPU machine with ``python -m pytest tests/gpu/test_kernels_gpu.py -q`` (about a minute
including Triton compilation). Shapes are mid-sized and deliberately not multiples of the tiles.
"""

from __future__ import annotations

import pytest
import torch

from hacrl_megatron.algo import LossInputs
from hacrl_megatron.kernels import fused_hacpo_loss, resolve_backend, sequence_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N, H, V = 1000, 256, 5003
LENS = [1, 199, 300, 17, 483]


def _case(dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.empty(N, H, device="cuda", dtype=dtype).normal_(0, H**-0.25, generator=g).requires_grad_(True)
    weight = torch.empty(V, H, device="cuda", dtype=dtype).normal_(0, H**-0.25, generator=g).requires_grad_(True)
    targets = torch.randint(0, V, (N,), device="cuda", generator=g)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], device="cuda")
    return hidden, weight, targets, cu


def _run(impl, hidden, weight, targets, cu, temperature):
    up = torch.linspace(-1, 1, N, device="cuda")
    out = sequence_logprobs(hidden, weight, targets, cu, temperature=temperature, impl=impl)
    grads = torch.autograd.grad((out.token_logps * up).sum() + out.seq_logp_sum.sum(), (hidden, weight))
    return out, grads


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_matches_reference_on_cuda(dtype, tol, temperature):
    case = _case(dtype)
    tri, (dh_t, dw_t) = _run("triton", *case, temperature)
    ref, (dh_r, dw_r) = _run("reference", *case, temperature)
    assert tri.token_logps.dtype == torch.float32 and dh_t.dtype == dtype and dw_t.dtype == dtype
    torch.testing.assert_close(tri.token_logps, ref.token_logps, rtol=0, atol=1e-4 if dtype == torch.float32 else 2e-3)
    torch.testing.assert_close(tri.seq_logp_sum, ref.seq_logp_sum, rtol=1e-5, atol=1e-2)
    torch.testing.assert_close(dh_t.float(), dh_r.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(dw_t.float(), dw_r.float(), rtol=tol, atol=tol)
    # the fp32 path is also checked against full logits in float64
    if dtype == torch.float32:
        h64, w64 = case[0].detach().double(), case[1].detach().double()
        naive = torch.log_softmax((h64 @ w64.t()) / temperature, -1).gather(1, case[2][:, None])[:, 0]
        torch.testing.assert_close(tri.token_logps.double(), naive, rtol=0, atol=1e-4)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_batch_invariant_at_any_offset_on_cuda(impl):
    hidden, weight, targets, cu = _case(torch.bfloat16)
    with torch.no_grad():
        full = sequence_logprobs(hidden, weight, targets, cu, impl=impl)
        again = sequence_logprobs(hidden, weight, targets, cu, impl=impl)
        assert torch.equal(full.token_logps, again.token_logps)
        bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
        for s, (a, b) in enumerate(bounds):
            alone = sequence_logprobs(hidden[a:b], weight, targets[a:b], torch.tensor([0, b - a], device="cuda"),
                                      impl=impl)
            assert torch.equal(alone.token_logps, full.token_logps[a:b]), (impl, s)
            assert torch.equal(alone.seq_logp_sum[0], full.seq_logp_sum[s]), (impl, s)


def test_auto_picks_triton_on_cuda():
    assert resolve_backend("auto", torch.device("cuda")).name == "triton"


def test_fused_hacpo_triton_matches_reference_on_cuda():
    from hacrl_megatron.config import HACPOConfig

    hidden, weight, targets, cu = _case(torch.bfloat16, seed=1)
    with torch.no_grad():
        base = sequence_logprobs(hidden, weight, targets, cu, impl="reference").seq_logp_sum
    lens = (cu[1:] - cu[:-1]).float()
    inputs = LossInputs(
        source_logp_sum=(base / lens + torch.tensor([0.0, 0.05, 0.1, -0.02, 0.12], device="cuda")) * lens,
        source_len=lens.long(), advantages=torch.tensor([0.5, -1.0, 0.8, 1.2, -0.3], device="cuda"),
        is_self=torch.tensor([True, False, False, True, False], device="cuda"),
        discrepancy=torch.tensor([1.0, 2.0, 0.5, 1.0, 1.5], device="cuda"))
    kw = dict(inputs=inputs, update_index=1, cfg=HACPOConfig())
    out = {}
    for impl in ("triton", "reference"):
        loss, _ = fused_hacpo_loss(hidden, weight, targets, cu, impl=impl, **kw)
        out[impl] = (loss, *torch.autograd.grad(loss, (hidden, weight)))
    torch.testing.assert_close(out["triton"][0], out["reference"][0], rtol=1e-4, atol=1e-5)
    for a, b in zip(out["triton"][1:], out["reference"][1:]):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=1e-4)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_on_policy_ratio_is_exactly_one_on_cuda(impl):
    """Old log-probs over the whole batch, new ones in a reordered sub-batch: s = 1 exactly."""
    from hacrl_megatron.config import HACPOConfig

    hidden, weight, targets, cu = _case(torch.bfloat16, seed=2)
    with torch.no_grad():
        old = sequence_logprobs(hidden, weight, targets, cu, impl=impl)
    pick = [3, 1, 4]
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    idx = torch.cat([torch.arange(*bounds[s], device="cuda") for s in pick])
    lens = torch.tensor([LENS[s] for s in pick], device="cuda")
    cu_mb = torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"), lens.cumsum(0)])
    inputs = LossInputs(advantages=torch.tensor([1.0, -1.0, 0.5], device="cuda"),
                        is_self=torch.ones(3, dtype=torch.bool, device="cuda"), discrepancy=torch.ones(3, device="cuda"),
                        source_logp_sum=old.seq_logp_sum[pick], source_len=lens)
    _, metrics = fused_hacpo_loss(hidden[idx], weight, targets[idx], cu_mb, inputs=inputs, update_index=0,
                                  cfg=HACPOConfig(), impl=impl)
    assert metrics["self_ratio_min"] == 1.0 and metrics["self_ratio_max"] == 1.0
