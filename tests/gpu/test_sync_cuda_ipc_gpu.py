"""CUDA IPC payloads between two processes that number their GPUs differently (GPU only).

The receiver runs with ``CUDA_VISIBLE_DEVICES`` set to the sender's GPU alone, as an SGLang server
started by ``SGLangServer(gpu_ids=[...])`` does: our UUID payload must land on that GPU (local
index 0 in the receiver) with the sender's values. With 2+ GPUs the sender's tensor sits on
``cuda:1`` and torch's default payload (index 1) must fail in the receiver, which sees one GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hacrl_megatron.sync.cuda_ipc import device_uuid, dumps_named_tensors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
REPO = Path(__file__).resolve().parents[2]

RECEIVER = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from hacrl_megatron.sync.cuda_ipc import device_uuid, loads_named_tensors
payload = sys.stdin.read()
try:
    [(name, t)] = loads_named_tensors(payload) if sys.argv[2] == "ours" else __import__("pickle").loads(
        __import__("base64").b64decode(payload))
except Exception as e:
    print("FAILED", type(e).__name__, e); sys.exit(0)
print(name, t.device.index, device_uuid(t.device.index), float(t.float().sum()))
"""


def _receive(payload: str, gpu: int, kind: str) -> str:
    import torch.multiprocessing  # noqa: F401

    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
    out = subprocess.run([sys.executable, "-c", RECEIVER, str(REPO), kind], input=payload, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_uuid_payload_rebuilds_on_the_senders_gpu():
    gpu = 1 if torch.cuda.device_count() > 1 else 0
    t = torch.arange(1000, dtype=torch.bfloat16, device=f"cuda:{gpu}")
    line = _receive(dumps_named_tensors([("w", t)]), gpu, "ours")
    name, index, uuid, total = line.split()
    assert (name, int(index), uuid) == ("w", 0, device_uuid(gpu))
    assert float(total) == float(t.float().sum())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs to make the indices differ")
def test_default_payload_names_a_device_the_receiver_lacks():
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    t = torch.ones(10, device="cuda:1")
    buf = io.BytesIO()
    ForkingPickler(buf).dump([("w", t)])
    assert _receive(base64.b64encode(buf.getvalue()).decode(), 1, "torch").startswith("FAILED")
