"""Trainer offload on CUDA (agents/offload.py, GPU only): the device memory a LocalAgent's sleep gives back
(measured with ``torch.cuda.mem_get_info``, what another process such as a colocated SGLang server can
take), by level, against the bytes it parked in pinned host memory; and the state after the wake is
bit-identical, in the same storages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("megatron.core")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_sleep_frees_the_parked_device_memory_and_wake_restores_it_bit_identically():
    sys.path.insert(0, str(BENCHMARKS))  # gpu_check.sh's agent step measures the same (one function for both)
    from gpu_check_megatron import colocation_memory

    data = colocation_memory(hidden=512, layers=2, vocab=8192)
    mib = 2**20
    assert data["parked_mib"]["all"] > data["parked_mib"]["optimizer"] > 0
    # what the sleep parked comes back as free device memory (the allocator rounds blocks: 95 %)
    for level in ("optimizer", "all"):
        freed = data["free_mib"][level] - data["free_mib"]["none"]
        assert freed >= 0.95 * data["parked_mib"][level], (level, data)
    assert data["free_mib"]["all"] - data["free_mib"]["resident"] > 0
    assert data["pinned_when_cuda"] and data["identical"] and data["update_after_wake_finite"]
    assert data["free_mib"]["awake_again"] * mib <= data["free_mib"]["none"] * mib + 64 * mib
