"""Accelerators the planner knows: dense bf16 peak, HBM bandwidth and capacity, link bandwidths.

Figures are the vendors' datasheet numbers for the SXM parts (dense, i.e. without 2:4 sparsity).
Memory is what ``--gpu-memory-gib`` defaults to; the planner never assumes more than that.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    """One accelerator model. Units: TFLOP/s, GB/s (10^9 bytes), GiB."""

    name: str
    bf16_tflops: float  # dense bf16 tensor-core peak
    hbm_gbps: float  # HBM bandwidth
    memory_gib: float  # usable device memory of the part (datasheet GB converted to GiB)
    nvlink_gbps: float  # NVLink bandwidth per GPU, one direction
    network_gbps: float  # inter-node bandwidth per GPU (one 400 Gb/s NIC per GPU = 50 GB/s)


GPUS: dict[str, GPU] = {
    "a100": GPU("A100-SXM4-80GB", 312.0, 2039.0, 80e9 / 2**30, 300.0, 25.0),
    "h100": GPU("H100-SXM5-80GB", 989.0, 3350.0, 80e9 / 2**30, 450.0, 50.0),
    "h200": GPU("H200-SXM-141GB", 989.0, 4800.0, 141e9 / 2**30, 450.0, 50.0),
    "b200": GPU("B200-SXM-180GB", 2250.0, 8000.0, 180e9 / 2**30, 900.0, 50.0),
}


class UnknownGPUError(ValueError):
    """``--gpu`` names no known accelerator."""


def gpu_by_name(name: str) -> GPU:
    """The :class:`GPU` for ``name`` (case-insensitive: a100, h100, h200, b200)."""
    key = name.strip().lower().replace("-", "").replace("_", "")
    for prefix, gpu in GPUS.items():
        if key == prefix or key.startswith(prefix):
            return gpu
    raise UnknownGPUError(f"--gpu {name!r} is not known; known: {sorted(GPUS)} (peak bf16 TFLOP/s and HBM GB/s "
                          "are needed for the time estimate)")
