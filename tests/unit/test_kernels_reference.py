"""The chunked torch reference of ``sequence_logprobs`` against full-logits computations.

Float64 comparisons are exact up to rounding (1e-12); half-precision inputs are compared with the
float32 computation on the same (upcast) values with a bf16/fp16-sized tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hacrl_megatron.kernels import SequenceLogProbs, resolve_backend, sequence_logprobs

torch.set_num_threads(1)


def make_case(n: int, h: int, v: int, lens: list[int] | None = None, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.7).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * 0.7).to(dtype).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g)
    lens = lens or [n]
    assert sum(lens) == n
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return hidden, weight, targets, cu


def naive_logps(hidden, weight, targets, temperature=1.0):
    logits = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32)) / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]


def grads(out, inputs, upstream):
    return torch.autograd.grad((out * upstream).sum(), inputs)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk_size", [None, 1, 7, 16])
def test_matches_naive_float64(temperature, chunk_size):
    hidden, weight, targets, cu = make_case(41, 12, 37, lens=[1, 9, 13, 1, 17])
    out = sequence_logprobs(hidden, weight, targets, cu, temperature=temperature, impl="reference",
                            chunk_size=chunk_size)
    ref = naive_logps(hidden, weight, targets, temperature)
    assert isinstance(out, SequenceLogProbs)
    assert out.token_logps.dtype == torch.float64
    torch.testing.assert_close(out.token_logps, ref, rtol=0, atol=1e-12)
    sums = torch.stack([ref[a:b].sum() for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(out.seq_logp_sum, sums, rtol=0, atol=1e-12)
    assert out.seq_len.tolist() == [1, 9, 13, 1, 17]
    upstream = torch.randn(41, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for got, want in zip(grads(out.token_logps, (hidden, weight), upstream),
                         grads(ref, (hidden, weight), upstream)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_gradient_through_sequence_sums_float64():
    hidden, weight, targets, cu = make_case(20, 8, 30, lens=[3, 1, 16])
    out = sequence_logprobs(hidden, weight, targets, cu, impl="reference", chunk_size=4)
    coef = torch.tensor([0.5, -2.0, 1.25], dtype=torch.float64)
    got = torch.autograd.grad((out.seq_logp_sum * coef).sum(), (hidden, weight))
    ref = naive_logps(hidden, weight, targets)
    want = torch.autograd.grad((ref * coef.repeat_interleave(torch.tensor([3, 1, 16]))).sum(), (hidden, weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_accumulate_in_float32(dtype):
    hidden, weight, targets, cu = make_case(33, 16, 45, lens=[10, 23], dtype=dtype)
    out = sequence_logprobs(hidden, weight, targets, cu, temperature=0.8, impl="reference", chunk_size=8)
    assert out.token_logps.dtype == torch.float32 and out.seq_logp_sum.dtype == torch.float32
    h32 = hidden.detach().float().requires_grad_(True)
    w32 = weight.detach().float().requires_grad_(True)
    ref = naive_logps(h32, w32, targets, 0.8)
    torch.testing.assert_close(out.token_logps, ref, rtol=0, atol=1e-5)
    upstream = torch.linspace(-1, 1, 33)
    got = grads(out.token_logps, (hidden, weight), upstream)
    want = grads(ref, (h32, w32), upstream)
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    for a, b in zip(got, want):
        assert a.dtype == dtype  # gradients come back in the input dtype
        torch.testing.assert_close(a.float(), b, rtol=tol, atol=tol)


def test_vocab_padding_rows_are_excluded():
    hidden, weight, targets, cu = make_case(12, 8, 20, lens=[5, 7])
    targets = targets % 17  # real vocabulary: 17 ids; rows 17..19 are padding
    out = sequence_logprobs(hidden, weight, targets, cu, impl="reference", vocab_size=17, chunk_size=4)
    ref = naive_logps(hidden, weight[:17], targets)
    torch.testing.assert_close(out.token_logps, ref, rtol=0, atol=1e-12)
    _, dw = grads(out.token_logps, (hidden, weight), torch.ones(12, dtype=torch.float64))
    assert torch.all(dw[17:] == 0) and torch.any(dw[:17] != 0)


def test_batch_invariant_and_deterministic():
    """A sequence's log-probs are bitwise equal alone and inside any batch, and across runs."""
    hidden, weight, targets, cu = make_case(70, 32, 300, lens=[1, 8, 21, 40], dtype=torch.float32)
    full = sequence_logprobs(hidden, weight, targets, cu, impl="reference", chunk_size=16)
    again = sequence_logprobs(hidden, weight, targets, cu, impl="reference", chunk_size=16)
    assert torch.equal(full.token_logps, again.token_logps) and torch.equal(full.seq_logp_sum, again.seq_logp_sum)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    for s, (a, b) in enumerate(bounds):
        alone = sequence_logprobs(hidden[a:b], weight, targets[a:b], torch.tensor([0, b - a]), impl="reference",
                                  chunk_size=16)
        assert torch.equal(alone.token_logps, full.token_logps[a:b]), f"sequence {s} changed alone"
        assert torch.equal(alone.seq_logp_sum[0], full.seq_logp_sum[s]), f"sequence {s} sum changed alone"
    # a different batch composition (reversed order) leaves every sequence unchanged
    order = [3, 2, 1, 0]
    idx = torch.cat([torch.arange(*bounds[s]) for s in order])
    lens = [bounds[s][1] - bounds[s][0] for s in order]
    cu2 = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    shuffled = sequence_logprobs(hidden[idx], weight, targets[idx], cu2, impl="reference", chunk_size=16)
    assert torch.equal(shuffled.token_logps, full.token_logps[idx])
    assert torch.equal(shuffled.seq_logp_sum, full.seq_logp_sum[order])


def test_backward_is_deterministic():
    hidden, weight, targets, cu = make_case(50, 16, 200, lens=[20, 30], dtype=torch.float32)
    runs = []
    for _ in range(2):
        out = sequence_logprobs(hidden, weight, targets, cu, temperature=0.9, impl="reference", chunk_size=8)
        runs.append(torch.autograd.grad(out.seq_logp_sum.sum(), (hidden, weight)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_materialises_more_than_one_chunk_of_logits():
    n, h, v, chunk = 256, 8, 500, 16
    hidden, weight, targets, cu = make_case(n, h, v, lens=[100, 156], dtype=torch.float32)
    with _LargestTensor() as mode:
        out = sequence_logprobs(hidden, weight, targets, cu, impl="reference", chunk_size=chunk)
        (out.token_logps.sum() + out.seq_logp_sum.sum()).backward()
    # forward tiles [chunk, V]; backward slices [N, ceil(chunk·V/N)]; the gradient dW itself is V·H
    bound = max(chunk * v, n * -(-chunk * v // n), v * h, n * h)
    assert mode.largest <= bound < n * v // 10, (mode.largest, bound)


def _bad(**over):
    hidden, weight, targets, cu = make_case(10, 4, 9, lens=[4, 6], dtype=torch.float32)
    args = dict(hidden=hidden, weight=weight, targets=targets, cu_seqlens=cu)
    kw = {k: over.pop(k) for k in list(over) if k not in args}
    args.update(over)
    return args, kw


@pytest.mark.parametrize("over, message", [
    (dict(hidden=torch.zeros(10, 5)), "hidden size"),
    (dict(hidden=torch.zeros(10)), "must be \\[N, H\\]"),
    (dict(weight=torch.zeros(9, 4, dtype=torch.float64)), "one floating dtype"),
    (dict(targets=torch.zeros(9, dtype=torch.int64)), "targets must be \\[N=10\\]"),
    (dict(targets=torch.zeros(10)), "int32/int64"),
    (dict(targets=torch.full((10,), 9)), "targets must lie in \\[0, vocab_size=9\\)"),
    (dict(targets=torch.full((10,), -1)), "got min -1"),
    (dict(cu_seqlens=torch.tensor([0, 4, 9])), "end at N=10"),
    (dict(cu_seqlens=torch.tensor([1, 4, 10])), "start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 6, 4, 10])), "strictly increasing"),
    (dict(cu_seqlens=torch.tensor([0, 4, 4, 10])), "cu_seqlens\\[1\\]=4 >= cu_seqlens\\[2\\]=4"),
    (dict(cu_seqlens=torch.tensor([0.0, 10.0])), "integer"),
    (dict(cu_seqlens=torch.tensor([0])), "S >= 1"),
    (dict(temperature=0.0), "temperature=0.0"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(chunk_size=0), "chunk_size=0"),
    (dict(impl="cuda"), "impl='cuda'"),
    (dict(vocab_size=10), "vocab_size=10"),
])
def test_bad_input_raises_clear_error(over, message):
    args, kw = _bad(**over)
    with pytest.raises(ValueError, match=message):
        sequence_logprobs(**args, **kw)


def test_triton_on_cpu_without_interpreter_says_so(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu")).name == "reference"


def test_import_is_lazy_and_reference_runs_without_triton():
    """``import hacrl_megatron.kernels`` and the reference path never import triton."""
    code = ("import sys, torch\n"
            "from hacrl_megatron.kernels import sequence_logprobs\n"
            "out = sequence_logprobs(torch.randn(4, 3), torch.randn(5, 3), torch.tensor([0, 1, 2, 4]),"
            " torch.tensor([0, 4]))\n"
            "assert 'triton' not in sys.modules, 'triton was imported'\n"
            "print(float(out.seq_logp_sum[0]))\n")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert float(res.stdout.strip()) < 0
