"""sync/cuda_ipc.py on CPU: the reducer names the GPU by UUID, the receiver maps it to its own index.

No CUDA here, so the CUDA-specific step is exercised with a stand-in for torch's ``reduce_tensor``
that returns what torch returns for a CUDA tensor on device 3 (torch's ``rebuild_cuda_tensor`` and
its 15 arguments), and with a recording rebuild on the receiving side. The real round trip between
two processes with different ``CUDA_VISIBLE_DEVICES`` is tests/gpu/test_sync_cuda_ipc_gpu.py.
"""

from __future__ import annotations

import base64
import functools
import pickletools
from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing import reductions

from hacrl_megatron.sync import cuda_ipc

SENDER_GPUS = {3: "GPU-3f1c-sender-view-3"}
RECEIVER_GPUS = ["GPU-aaaa-other", "GPU-3f1c-sender-view-3"]  # the same GPU is index 1 for the server


def fake_cuda_reduce(tensor: torch.Tensor):
    """What torch's reduce_tensor returns for a CUDA tensor on device 3 (handles are opaque bytes)."""
    return reductions.rebuild_cuda_tensor, (
        torch.Tensor, tensor.size(), tensor.stride(), 0, torch.storage.TypedStorage, tensor.dtype,
        3, b"ipc-handle", tensor.numel() * 4, 0, False, b"ref-counter", 0, b"event", True)


def test_device_argument_is_where_torch_puts_it():
    assert cuda_ipc._device_arg_position() == 6  # storage_device in torch's rebuild_cuda_tensor


def test_payload_carries_the_uuid_not_the_index():
    reduce = functools.partial(cuda_ipc.reduce_tensor_by_uuid, base_reduce=fake_cuda_reduce,
                               uuid_of=SENDER_GPUS.__getitem__)
    payload = cuda_ipc.dumps_named_tensors([("w", torch.zeros(2, 3))], reduce=reduce)
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(base64.b64decode(payload))]
    strings = [arg for _, arg in ops if isinstance(arg, str)]
    # the rebuild function is torch's, by name: the only CUDA rebuild SGLang's restricted unpickler allows
    assert "torch.multiprocessing.reductions" in strings and "rebuild_cuda_tensor" in strings
    assert SENDER_GPUS[3] in strings

    seen = []

    def raw(*args):  # the receiver without the UUID mapping sees the string
        seen.append(args)
        return torch.ones(2, 3)

    cuda_ipc.loads_named_tensors(payload, rebuild=raw)
    assert seen[0][6] == SENDER_GPUS[3] and not isinstance(seen[0][6], int)

    mapped = []
    receive = functools.partial(cuda_ipc.rebuild_cuda_tensor_by_uuid,
                                base_rebuild=lambda *a: mapped.append(a) or torch.full((2, 3), 5.0),
                                index_of=RECEIVER_GPUS.index)
    [(name, tensor)] = cuda_ipc.loads_named_tensors(payload, rebuild=receive)
    assert name == "w" and torch.equal(tensor, torch.full((2, 3), 5.0))
    assert mapped[0][6] == 1  # the receiver's own index of the sender's GPU
    assert mapped[0][:6] == seen[0][:6] and mapped[0][7:] == seen[0][7:]  # nothing else changed


def test_torch_default_reducer_would_send_the_index():
    """The bug being fixed: with torch's reducer as is, the payload's device is the integer 3."""
    seen = []
    payload = cuda_ipc.dumps_named_tensors([("w", torch.zeros(2))], reduce=fake_cuda_reduce)
    cuda_ipc.loads_named_tensors(payload, rebuild=lambda *a: seen.append(a) or torch.zeros(2))
    assert seen[0][6] == 3


def test_device_uuid_lookup(monkeypatch):
    props = [SimpleNamespace(uuid=u) for u in RECEIVER_GPUS]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    assert cuda_ipc.device_uuid(1) == RECEIVER_GPUS[1]
    assert cuda_ipc.device_index(RECEIVER_GPUS[1]) == 1
    with pytest.raises(ValueError, match="no visible CUDA device has uuid 'GPU-missing'"):
        cuda_ipc.device_index("GPU-missing")


def test_cpu_tensors_round_trip_unchanged():
    named = [("a.weight", torch.arange(6.0).reshape(2, 3)), ("b.bias", torch.ones(4, dtype=torch.bfloat16))]
    back = cuda_ipc.loads_named_tensors(cuda_ipc.dumps_named_tensors(named))
    assert [n for n, _ in back] == ["a.weight", "b.bias"]
    assert all(torch.equal(x, y) and x.dtype == y.dtype for (_, x), (_, y) in zip(named, back, strict=True))
