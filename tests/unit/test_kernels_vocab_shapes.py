"""Real vocabularies at TP 1/2/4/8: the Triton kernels' last vocab block under the GPU tile sizes.

One subprocess (``kernels_vocab_shapes_worker.py``, interpreter on CPU) runs every case on a
reduced shard with the same partly empty last 128-column block as the real rank 0 and last rank
(see its docstring for why that is equivalent). Checks that the ranks whose tail block holds the
next rank's ids are exactly the ones the padding arithmetic predicts, and that the kernels agree
with the reference there, both with raw out-of-shard ids (the kernel's own column mask) and with
ids mapped by ``core.local_target_ids``.
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

# (model, TP): whether a rank's last 128-column block also covers ids of the next rank
# (V_local = vocab / TP not a multiple of 128; the provider pads only to a multiple of TP)
TAILS = {
    ("qwen3", 1): False, ("qwen3", 2): True, ("qwen3", 4): True, ("qwen3", 8): True,
    ("llama3", 1): False, ("llama3", 2): False, ("llama3", 4): True, ("llama3", 8): True,
    ("qwen2.5", 1): False, ("qwen2.5", 2): False, ("qwen2.5", 4): False, ("qwen2.5", 8): True,
    ("smollm2", 1): False, ("smollm2", 2): False, ("smollm2", 4): False, ("smollm2", 8): False,
}
VOCABS = {"qwen3": 151936, "llama3": 128256, "qwen2.5": 152064, "smollm2": 49152}


@pytest.fixture(scope="module")
def result() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "tests.unit.kernels_vocab_shapes_worker"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout)


@pytest.mark.parametrize(("model", "tp"), sorted(TAILS), ids=[f"{m}-tp{t}" for m, t in sorted(TAILS)])
def test_real_vocab_tail_block(result, model, tp):
    r = result[f"{model}-tp{tp}"]
    assert r["padded"] == VOCABS[model] and r["v_local"] * tp == VOCABS[model]  # all divide by 8: no padding
    assert r["gpu_tail_before_next_rank"] is TAILS[(model, tp)]
    first = r["ranks"]["0"]
    assert (first["tail_ids"] > 0) is TAILS[(model, tp)]  # the checked targets do land in the tail
    for rank, c in r["ranks"].items():
        for name in ("raw", "mapped"):
            assert c[f"{name}_finite"], (rank, name, c)
            # fp32, two summation orders: Σexp over up to 256 columns (values up to ~256) differs by
            # a few ulps of 256 (2**-15 each); dlogits are single exps in [-1, 1]
            assert c[f"{name}_err"] < 1e-4 and c[f"{name}_grad_err"] < 1e-6, (rank, name, c)
