"""The Triton kernels compile for an H100/H200 (sm_90) on this GPU-less machine.

The interpreter (``test_kernels_triton.py``) checks the kernels' arithmetic but not that the
compiler accepts them; Triton's ahead-of-time path (``triton.compile`` with a ``GPUTarget``, the
ptxas bundled in the wheel) runs without a device and catches type and lowering errors. Pointers,
strides and K are declared 16-divisible, as a launch with H % 16 == 0 specialises them; then bf16
must lower ``tl.dot`` to Hopper's warp-group MMA (``wgmma``) and the K loop must be software-
pipelined (``cp.async`` multi-buffering). Runs in a subprocess so that an
interpreter setting elsewhere in the pytest process cannot swap the kernels for interpreted ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hacrl_megatron.kernels import triton_impl as ti

def signature(fn, dtype, const):
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in ("h_ptr", "w_ptr", "d_ptr"):
            sig[name] = "*" + dtype
        elif name == "tgt_ptr":
            sig[name] = "*i64"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        else:
            sig[name] = "fp32" if name == "temperature" else "i32"
    return sig

def aligned(fn):
    # what a real launch specialises for 16-byte aligned tensors and 16-divisible ints
    names = [i for i, n in enumerate(fn.arg_names) if n.endswith("_ptr") or n.startswith("stride") or n == "K"]
    return {(i,): [["tt.divisibility", 16]] for i in names}

out = {}
for dtype, even_k in (("bf16", True), ("bf16", False), ("fp32", True)):
    const = dict(BLOCK_M=128, BLOCK_V=128, BLOCK_K=64, PRECISION="ieee" if dtype == "fp32" else "tf32",
                 UPCAST=False, EVEN_K=even_k)
    for fn in (ti._shard_stats_kernel, ti._grad_logits_kernel):
        src = ASTSource(fn, signature(fn, dtype, const), const, attrs=aligned(fn))
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
        ptx = kernel.asm["ptx"]
        out[f"{fn.__name__}/{dtype}/{even_k}"] = {"wgmma": "wgmma" in ptx, "cp_async": "cp.async" in ptx,
                                                  "cubin_bytes": len(kernel.asm["cubin"])}
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out) == 6
    for name, info in out.items():
        assert info["cubin_bytes"] > 1000, name
        assert info["wgmma"] == ("/bf16/" in name), (name, info)  # fp32 'ieee' stays on FMA units
        if "/bf16/" in name:
            assert info["cp_async"], (name, info)
