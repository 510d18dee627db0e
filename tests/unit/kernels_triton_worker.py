"""Runs the Triton backend under ``TRITON_INTERPRET=1`` on CPU tensors; prints one JSON result.

Executed in a fresh subprocess by ``test_kernels_triton.py``: triton reads TRITON_INTERPRET when
the kernels are decorated, so the variable must be set before anything imports them, whatever
other test modules of the same pytest process have imported.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from hacrl_megatron.algo import LossInputs  # noqa: E402
from hacrl_megatron.config import HACPOConfig  # noqa: E402
from hacrl_megatron.kernels import fused_hacpo_loss, sequence_logprobs  # noqa: E402

torch.set_num_threads(1)


def _case(n, h, v, lens, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return hidden, weight, targets, cu


def _max_err(a, b):
    return float((a.detach().float() - b.detach().float()).abs().max())


def compare(n, h, v, lens, temperature, dtype=torch.float32, vocab_size=None):
    """Max abs differences triton − reference: token log-probs, sums, dH, dW."""
    hidden, weight, targets, cu = _case(n, h, v, lens, dtype)
    if vocab_size is not None:
        targets = targets % vocab_size
    up = torch.randn(n, generator=torch.Generator().manual_seed(1))
    res = {}
    outs = {}
    for impl in ("triton", "reference"):
        out = sequence_logprobs(hidden, weight, targets, cu, temperature=temperature, impl=impl, chunk_size=16,
                                vocab_size=vocab_size)
        loss = (out.token_logps * up).sum() + out.seq_logp_sum.sum()
        outs[impl] = (out, *torch.autograd.grad(loss, (hidden, weight)))
    (a, dha, dwa), (b, dhb, dwb) = outs["triton"], outs["reference"]
    res["logp"] = _max_err(a.token_logps, b.token_logps)
    res["sum"] = _max_err(a.seq_logp_sum, b.seq_logp_sum)
    res["dh"], res["dw"] = _max_err(dha, dhb), _max_err(dwa, dwb)
    res["dtypes"] = [str(a.token_logps.dtype), str(dha.dtype), str(dwa.dtype)]
    res["scale"] = float(b.token_logps.detach().abs().max())
    if vocab_size is not None:
        res["pad_grad_zero"] = bool((dwa[vocab_size:] == 0).all())
    return res


def invariance():
    """Bitwise: each sequence alone vs inside two different batches, and a second run.

    Bitwise only where a sequence starts at a multiple of the interpreter's BLOCK_M (16): numpy's
    BLAS, which the interpreter uses for ``tl.dot``, rounds a row differently depending on its
    position inside a tile (measured: the raw split statistics of the sequence at offset 17 differ
    in the last bit on AVX-512, AVX2 and ATen's default kernels alike; its final log-probs came out
    equal on AVX-512 and AVX2 by luck and 1 ulp apart under ATEN_CPU_CAPABILITY=default), unlike GPU
    MMA; the GPU test checks arbitrary offsets bitwise. The sequence at offset 17 must agree within
    4 float32 ulps of its log-probs (|logp| < 16, so 4·2**-20), which a kernel that mixed sequences
    or lost a tile would exceed by orders of magnitude.
    """
    hidden, weight, targets, cu = _case(64, 32, 300, [16, 1, 15, 32])
    hidden.requires_grad_(False)
    runs = [sequence_logprobs(hidden, weight, targets, cu, impl="triton").token_logps for _ in range(2)]
    ok = {"two_runs": bool(torch.equal(runs[0], runs[1]))}
    grads = [torch.autograd.grad(sequence_logprobs(hidden, weight, targets, cu, impl="triton").seq_logp_sum.sum(),
                                 weight)[0] for _ in range(2)]
    ok["backward_two_runs"] = bool(torch.equal(grads[0], grads[1]))
    full = sequence_logprobs(hidden, weight, targets, cu, impl="triton")
    alone_ok = True
    for s, (a, b) in enumerate([(0, 16), (16, 17), (17, 32), (32, 64)]):
        alone = sequence_logprobs(hidden[a:b], weight, targets[a:b], torch.tensor([0, b - a]), impl="triton")
        if a % 16 == 0:
            alone_ok &= torch.equal(alone.token_logps, full.token_logps[a:b])
            alone_ok &= torch.equal(alone.seq_logp_sum[0], full.seq_logp_sum[s])
        else:  # inside a tile: see the docstring
            alone_ok &= bool((alone.token_logps - full.token_logps[a:b]).abs().max() <= 4 * 2.0**-20)
            alone_ok &= bool((alone.seq_logp_sum[0] - full.seq_logp_sum[s]).abs() <= 4 * (b - a) * 2.0**-20)
    ok["alone"] = bool(alone_ok)
    # another batch: the 32-token sequence first, then a different 16-token filler
    filler = torch.randn(16, 32, generator=torch.Generator().manual_seed(5)) * 0.5
    h2 = torch.cat([hidden[32:64], filler])
    t2 = torch.cat([targets[32:64], targets[:16].flip(0)])
    other = sequence_logprobs(h2, weight, t2, torch.tensor([0, 32, 48]), impl="triton")
    ok["other_batch"] = bool(torch.equal(other.token_logps[:32], full.token_logps[32:64])
                             and torch.equal(other.seq_logp_sum[0], full.seq_logp_sum[3]))
    return ok


def fused():
    """fused_hacpo_loss on the Triton path vs the same call on the reference path."""
    hidden, weight, targets, cu = _case(40, 16, 70, [5, 1, 14, 20])
    with torch.no_grad():
        base = sequence_logprobs(hidden, weight, targets, cu, impl="reference").seq_logp_sum
    lens = (cu[1:] - cu[:-1]).double()
    src_len = torch.tensor([6, 2, 14, 18])
    src_sum = (base.double() / lens + torch.tensor([0.0, 0.1, 0.05, 0.15])) * src_len
    inputs = LossInputs(source_logp_sum=src_sum, source_len=src_len, advantages=torch.tensor([0.8, -0.4, 1.1, 0.6]),
                        is_self=torch.tensor([True, False, False, False]),
                        discrepancy=torch.tensor([1.0, 2.0, 0.5, 1.5]))
    kw = dict(inputs=inputs, update_index=1, cfg=HACPOConfig(alpha=1.0), num_sequences=6, temperature=0.9)
    got = {}
    for impl in ("triton", "reference"):
        loss, metrics = fused_hacpo_loss(hidden, weight, targets, cu, impl=impl, **kw)
        got[impl] = (loss, *torch.autograd.grad(loss, (hidden, weight)), metrics)
    (la, dha, dwa, ma), (lb, dhb, dwb, mb) = got["triton"], got["reference"]
    return {"loss": abs(float(la - lb)), "dh": _max_err(dha, dhb), "dw": _max_err(dwa, dwb),
            "grad_scale": float(dhb.abs().max()), "num_cross": ma["num_cross"],
            "cross_clipfrac_equal": ma["cross_clipfrac"] == mb["cross_clipfrac"]}


def rejects_float64():
    hidden, weight, targets, cu = _case(4, 16, 40, [4], dtype=torch.float64)
    try:
        sequence_logprobs(hidden, weight, targets, cu, impl="triton")
    except ValueError as e:
        return str(e)
    return "no error"


def main() -> None:
    result = {
        "n1_v33": compare(1, 16, 33, [1], 1.0),
        "n37_v301_t07": compare(37, 24, 301, [1, 12, 24], 0.7),
        "n64_v300": compare(64, 32, 300, [3, 1, 29, 31], 1.0),
        "n20_v129_pad": compare(20, 16, 129, [7, 13], 1.3, vocab_size=120),
        "bf16": compare(24, 32, 200, [10, 14], 1.0, dtype=torch.bfloat16),
        "invariance": invariance(),
        "fused": fused(),
        "float64": rejects_float64(),
    }
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
