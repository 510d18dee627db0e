"""GEMM and buffer helpers shared by the kernel backends and ``core.py``'s backward.

Accumulation is in float32 (float64 for float64 inputs). Half-precision GEMMs on CUDA write an
fp32 result directly (tensor cores, no bf16 rounding of the output) where this torch supports
``out_dtype=``; on CPU half operands are upcast first (CPU half GEMMs are slow and round).
"""

from __future__ import annotations

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)

_cuda_out_dtype_mm: bool | None = None  # probed once: does torch.mm(..., out_dtype=) work here?


def acc_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Accumulation / output dtype: float32 for half and float32 inputs, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def half_gemm_on_cuda(a: torch.Tensor) -> bool:
    """True when a half-precision CUDA GEMM may write fp32 directly (probed once per process)."""
    global _cuda_out_dtype_mm
    if not (a.is_cuda and a.dtype in HALF_DTYPES):
        return False
    if _cuda_out_dtype_mm is None:
        try:  # exactly the two forms used below, with their ``out=`` buffers
            probe = torch.ones(16, 16, device=a.device, dtype=a.dtype)
            acc = torch.ones(16, 16, device=a.device, dtype=torch.float32)
            torch.addmm(acc, probe, probe, out_dtype=torch.float32, out=acc)
            buf = torch.empty(16, 16, device=a.device, dtype=torch.float32)
            torch.mm(probe, probe, out_dtype=torch.float32, out=buf)
            _cuda_out_dtype_mm = bool((acc == 17).all() and (buf == 16).all())
        except (RuntimeError, TypeError):
            _cuda_out_dtype_mm = False
    return _cuda_out_dtype_mm


def matmul_acc(a: torch.Tensor, b: torch.Tensor, acc_dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b returned in ``acc_dtype`` (into ``out`` when given), accumulated in at least float32.

    Half inputs on CUDA use the tensor cores with an fp32 output (no bf16 rounding of the
    result); elsewhere half operands are upcast (CPU half GEMMs are slow and round their output).
    """
    if a.dtype == acc_dtype and b.dtype == acc_dtype:
        return torch.mm(a, b, out=out)
    if half_gemm_on_cuda(a) and a.dtype == b.dtype:
        return torch.mm(a, b, out_dtype=acc_dtype, out=out)
    return torch.mm(a.to(acc_dtype), b.to(acc_dtype), out=out)


def workspace(buffer: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A contiguous [rows, cols] view of ``buffer``'s memory when it is large enough, else a new
    tensor. Re-using one buffer across chunks saves an allocation (and, on CPU, the page faults of
    a fresh mapping) per chunk, and keeps a single chunk alive at a time."""
    need = shape[0] * shape[1]
    if buffer is not None and buffer.dtype == dtype and buffer.numel() >= need:
        return buffer.view(-1)[:need].view(shape)
    return torch.empty(shape, dtype=dtype, device=device)


def addmm_acc_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in place, with ``acc`` in the accumulation dtype (fp32 or fp64)."""
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif half_gemm_on_cuda(a) and a.dtype == b.dtype:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
