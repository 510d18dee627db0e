"""Against a peer: megatron-core's own ``vocab_parallel_cross_entropy`` (negated) at TP = 1.

Megatron's function reads its tensor-parallel group from ``parallel_state``, so it runs in a
subprocess with a one-rank gloo world (no global state leaks into the pytest process). The TP = 2
comparison is in ``tests/distributed/test_kernels_tp.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

SCRIPT = r"""
import json, os, tempfile, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
torch.set_num_threads(1)
store = os.path.join(tempfile.mkdtemp(), "store")
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from hacrl_megatron.kernels import sequence_logprobs
parallel_state.initialize_model_parallel(1, 1)
g = torch.Generator().manual_seed(0)
result = {}
for temperature in (1.0, 0.7):
    hidden = torch.randn(29, 16, generator=g, requires_grad=True)
    weight = torch.randn(101, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 101, (29,), generator=g)
    cu = torch.tensor([0, 1, 12, 29])
    ours = sequence_logprobs(hidden, weight, targets, cu, temperature=temperature, impl="reference", chunk_size=8)
    # megatron works in place on its logits: hand it a fresh [s, b, V] tensor
    logits = ((hidden @ weight.t()) / temperature).view(29, 1, 101)
    theirs = -vocab_parallel_cross_entropy(logits.clone(), targets.view(29, 1)).view(29)
    up = torch.randn(29, generator=g)
    ga = torch.autograd.grad((ours.token_logps * up).sum(), (hidden, weight))
    gb = torch.autograd.grad((theirs * up).sum(), (hidden, weight))
    result[str(temperature)] = {
        "value": float((ours.token_logps - theirs).abs().max()),
        "dh": float((ga[0] - gb[0]).abs().max()), "dw": float((ga[1] - gb[1]).abs().max()),
        "scale": float(theirs.abs().max()),
    }
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
print(json.dumps(result))
"""


def test_matches_megatron_vocab_parallel_cross_entropy():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    for temperature, r in result.items():
        assert r["scale"] > 1.0  # non-trivial log-probs
        assert r["value"] < 2e-5 and r["dh"] < 2e-5 and r["dw"] < 2e-5, (temperature, r)
