"""The CUDA → CPU redirection for megatron-core (models/cpu_compat.py)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from hacrl_megatron.models.cpu_compat import cpu_compat_active, enable_cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the redirection is a no-op with CUDA")


def test_device_arguments_and_cuda_calls_land_on_cpu():
    assert enable_cpu_compat() is True
    assert enable_cpu_compat() is True  # idempotent
    assert cpu_compat_active()
    assert torch.ones(2, device="cuda").device.type == "cpu"
    assert torch.zeros(1, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.empty_like(torch.ones(3), device="cuda:0").device.type == "cpu"
    x = torch.ones(2)
    assert x.cuda() is x and x.to("cuda").device.type == "cpu" and x.to(0, torch.float64).dtype == torch.float64
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda.current_stream().wait_stream(stream)
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    assert event.elapsed_time(event) == 0.0


def test_type_check_answers_cuda_only_to_megatron_code():
    enable_cpu_compat()
    scope = {"__name__": "megatron.core.optimizer.fake", "torch": torch}
    exec("result = (torch.ones(1).type(), torch.ones(1, dtype=torch.bfloat16).type())", scope)
    assert scope["result"] == ("torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor")
    assert torch.ones(1).type() == "torch.FloatTensor"  # everyone else sees the truth


def test_rng_tracker_runs_on_the_cpu_generator():
    pytest.importorskip("megatron.core")
    enable_cpu_compat()
    from megatron.core.tensor_parallel import random as mrandom

    from hacrl_megatron.models.parallel import init_parallel

    init_parallel(1, 1, 1)  # the seed reads the TP rank: alone in a process, no other test made a world
    mrandom.model_parallel_cuda_manual_seed(7)
    tracker = mrandom.get_cuda_rng_tracker()
    torch.manual_seed(0)
    outside = torch.rand(1)
    torch.manual_seed(0)
    with tracker.fork():
        inside_a = torch.rand(1)
    after = torch.rand(1)
    assert torch.equal(after, outside)  # the default stream continues unaffected by the fork
    with tracker.fork():
        inside_b = torch.rand(1)
    assert not torch.equal(inside_a, inside_b)  # the tracked stream advanced


def test_other_threads_enable_their_own_mode():
    enable_cpu_compat()
    seen = {}

    def work():
        seen["before"] = cpu_compat_active()
        enable_cpu_compat()
        seen["device"] = torch.ones(1, device="cuda").device.type

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == {"before": False, "device": "cpu"}


def test_strict_no_op_when_cuda_is_available():
    code = (
        "import torch; torch.cuda.is_available = lambda: True\n"
        "orig = torch.cuda.current_device\n"
        "from hacrl_megatron.models.cpu_compat import enable_cpu_compat, cpu_compat_active\n"
        "assert enable_cpu_compat() is False and not cpu_compat_active()\n"
        "assert torch.cuda.current_device is orig\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
