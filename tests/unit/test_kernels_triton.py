"""The Triton backend, interpreted on CPU (``TRITON_INTERPRET=1``), against the torch reference.

All cases run in one fresh subprocess (``kernels_triton_worker.py``): the interpreter is chosen
when triton decorates the kernels, so the environment variable must be set before any import of
them — a subprocess is robust whatever the rest of the pytest process has imported. Shapes are
tiny (N ≤ 64, V ≤ 301, H ≤ 32); vocab sizes are not multiples of the 32-wide vocab block nor of
the 128-wide split, and there are ragged and length-1 sequences.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "tests.unit.kernels_triton_worker"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout)


@pytest.mark.parametrize("case", ["n1_v33", "n37_v301_t07", "n64_v300", "n20_v129_pad"])
def test_values_and_gradients_match_reference_fp32(result, case):
    r = result[case]
    assert r["scale"] > 1.0
    assert r["logp"] < 5e-6 and r["sum"] < 5e-5, r
    assert r["dh"] < 1e-5 and r["dw"] < 1e-5, r
    assert r["dtypes"] == ["torch.float32"] * 3


def test_vocab_padding_gets_zero_gradient(result):
    assert result["n20_v129_pad"]["pad_grad_zero"] is True


def test_bf16_accumulates_in_fp32_and_returns_bf16_grads(result):
    r = result["bf16"]
    assert r["dtypes"] == ["torch.float32", "torch.bfloat16", "torch.bfloat16"]
    assert r["logp"] < 1e-5, r  # same bf16 inputs, fp32 accumulation on both paths
    assert r["dh"] < 2e-2 and r["dw"] < 2e-2, r


def test_batch_invariant_and_deterministic(result):
    assert result["invariance"] == {"two_runs": True, "backward_two_runs": True, "alone": True, "other_batch": True}


def test_fused_hacpo_loss_matches_reference_path(result):
    r = result["fused"]
    assert r["num_cross"] == 3.0 and r["cross_clipfrac_equal"]
    assert r["grad_scale"] > 1e-3
    assert r["loss"] < 1e-6 and r["dh"] < 1e-6 and r["dw"] < 1e-6, r


def test_float64_is_rejected_with_advice(result):
    assert "impl='reference'" in result["float64"] and "float64" in result["float64"]
