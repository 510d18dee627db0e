"""The Triton kernels compile for an H100/H200 (sm_90) on this GPU-less machine.

The interpreter (``test_kernels_triton.py``) checks the kernels' arithmetic but not that the
compiler accepts them; Triton's ahead-of-time path (``triton.compile`` with a ``GPUTarget``, the
ptxas bundled in the wheel) runs without a device and catches type and lowering errors. Pointers,
strides and K are declared 16-divisible, as a launch with H % 16 == 0 specialises them; then bf16
must lower ``tl.dot`` to Hopper's warp-group MMA (``wgmma``) and the K loop must be software-
pipelined (``cp.async`` multi-buffering); with each dtype's launch tiles, ptxas (``-v``) must not
spill registers (fp32's FMA path gets narrower vocab tiles for that). Runs in a subprocess so that an
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
import json, os, re, subprocess, tempfile, warnings
warnings.filterwarnings("ignore")
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hacrl_megatron.kernels import triton_impl as ti
try:
    from triton.backends.nvidia.compiler import get_ptxas
    PTXAS = get_ptxas(90).path
except Exception:
    PTXAS = None

def registers(ptx):
    # ptxas -v on the kernel's PTX: registers per thread and spill bytes (None without ptxas)
    if PTXAS is None:
        return None, None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        open(path, "w").write(ptx)
        res = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", path, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return (int(regs.group(1)) if regs else None), (int(spill.group(1)) if spill else None)

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
    cfg = ti._config(torch.device("cuda"), torch.bfloat16 if dtype == "bf16" else torch.float32)  # the launch's
    const = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_V=cfg["BLOCK_V"], BLOCK_K=cfg["BLOCK_K"],
                 PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST=False, EVEN_K=even_k)
    for fn in (ti._shard_stats_kernel, ti._grad_logits_kernel):
        src = ASTSource(fn, signature(fn, dtype, const), const, attrs=aligned(fn))
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        ptx = kernel.asm["ptx"]
        regs, spill = registers(ptx)
        out[f"{fn.__name__}/{dtype}/{even_k}"] = {"wgmma": "wgmma" in ptx, "cp_async": "cp.async" in ptx,
                                                  "cubin_bytes": len(kernel.asm["cubin"]), "regs": regs,
                                                  "spill": spill}
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
        # the launch tiles fit the 255 registers a thread has: nothing spills to local memory (ptxas -v)
        assert info["regs"] is not None and info["spill"] == 0 and info["regs"] <= 255, (name, info)
        assert info["wgmma"] == ("/bf16/" in name), (name, info)  # fp32 'ieee' stays on FMA units
        if "/bf16/" in name:
            assert info["cp_async"], (name, info)
