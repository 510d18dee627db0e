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


def test_moe_router_gemm_runs_without_transformer_engine():
    """megatron-core 0.16.1 never defines ``te_general_gemm`` without TE: the router's gating GEMM
    raised NameError; with the fix it is torch.mm in the router dtype."""
    pytest.importorskip("megatron.core")
    enable_cpu_compat()
    from megatron.core.transformer.moe import moe_utils

    inp = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(4, 8, requires_grad=True)
    out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    torch.testing.assert_close(out, inp @ weight.t())
    out.sum().backward()
    torch.testing.assert_close(weight.grad, torch.ones(5, 4).t() @ inp.detach())


def test_all_to_all_split_sizes_are_host_lists_on_cpu():
    """The all-to-all dispatcher moves its split sizes to the host with ``maybe_move_tensor_to_cpu``,
    which converted CUDA tensors only: on a CPU ``all_to_all_single`` got tensors; now the same numpy
    arrays as on GPU (EP = 2 over gloo is tested in tests/distributed/test_moe_worlds.py)."""
    pytest.importorskip("megatron.core")
    import numpy as np

    enable_cpu_compat()
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for fn in (token_dispatcher.maybe_move_tensor_to_cpu, moe_utils.maybe_move_tensor_to_cpu):
        splits = fn(torch.tensor([3, 1]), as_numpy=True)
        assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]
        kept = torch.tensor([2])
        assert fn(kept) is kept  # as_numpy=False: unchanged, as on GPU for CPU tensors


def test_tensor_parallel_backwards_run_under_the_device_mapping():
    """The autograd engine runs ``Function.backward`` outside this thread's torch-function mode; the
    sequence-parallel and expert-parallel backwards of tensor_parallel/mappings.py and layers.py
    allocate on ``torch.cuda.current_device()`` there. A backward that allocates on "cuda" now gets a
    CPU tensor (the TP2·SP and EP2 worlds of tests/distributed/test_moe_worlds.py run them for real)."""
    pytest.importorskip("megatron.core")
    enable_cpu_compat()
    from megatron.core.tensor_parallel import layers, mappings

    wrapped = [cls for mod in (mappings, layers) for cls in vars(mod).values()
               if isinstance(cls, type) and issubclass(cls, torch.autograd.Function) and cls.__module__ == mod.__name__]
    assert len(wrapped) >= 10 and all(getattr(cls.backward, "_hacrl_cpu_compat", False) for cls in wrapped)

    class AllocatesOnCuda(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return torch.empty(grad.shape, device=torch.cuda.current_device()).copy_(grad) * 2

    from hacrl_megatron.models.cpu_compat import _run_backward_under_mode

    _run_backward_under_mode(AllocatesOnCuda)
    x = torch.ones(3, requires_grad=True)
    AllocatesOnCuda.apply(x).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]
