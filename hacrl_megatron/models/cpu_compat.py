"""Run megatron-core on machines without CUDA (CPU + gloo): tests, CI and the CPU demo.

megatron-core hard-codes CUDA in about a dozen places that TP, PP, DP, DDP, the (distributed)
optimizer and ``dist_checkpointing`` all go through, and no configuration flag avoids them.
Rather than patch or fork megatron's source, :func:`enable_cpu_compat` redirects those calls
from outside: a :class:`torch.overrides.TorchFunctionMode` maps CUDA device arguments, ``.cuda()``
and ``pin_memory()`` to the CPU and answers megatron's ``.type() == 'torch.cuda.FloatTensor'``
checks; ``torch.cuda`` streams, events, ``current_device`` and the RNG functions become CPU
stand-ins; megatron's RNG tracker uses the CPU generator. The reasoning and the inventory of
redirected megatron-core call sites (with the version it was taken from) are in docs/cpu_compat.md.

Modes are thread-local, so :func:`enable_cpu_compat` installs the mode in the *calling* thread;
call it again from any other thread that runs megatron code (it is idempotent per thread and
cheap). Set ``HACRL_CPU_COMPAT_LOG=1`` to log every distinct call site that gets redirected.

When ``torch.cuda.is_available()`` is true every function here is a strict no-op.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_GLOBAL_PATCHED = False
_TLS = threading.local()
_LOGGED_SITES: set[tuple[str, int]] = set()
_LOG = os.environ.get("HACRL_CPU_COMPAT_LOG", "") not in ("", "0")
_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int64: "torch.cuda.LongTensor",
}


def cpu_compat_active() -> bool:
    """True when the CPU redirection is installed in the calling thread."""
    return bool(getattr(_TLS, "mode", None))


def enable_cpu_compat() -> bool:
    """Install the CUDA → CPU redirection for megatron-core (idempotent, per thread for the mode).

    Returns True when the redirection is active, False when CUDA is available (nothing done).
    """
    if torch.cuda.is_available():
        return False
    global _GLOBAL_PATCHED
    if not _GLOBAL_PATCHED:
        _patch_torch_cuda()
        _patch_megatron_rng()
        _patch_megatron_recompute()
        _patch_megatron_backward_allocations()
        _patch_megatron_moe()
        _GLOBAL_PATCHED = True
    if not cpu_compat_active():
        mode = _CudaToCpuMode()
        mode.__enter__()  # stays on this thread's mode stack for the life of the thread
        _TLS.mode = mode
    return True


# --------------------------------------------------------------------------------------------
# torch.cuda stand-ins


class _Stream:
    """Inert CUDA stream: CPU kernels run in program order, so waits and syncs are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _Event:
    """Inert CUDA event; ``elapsed_time`` is 0 because nothing is timed asynchronously on CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_DEFAULT_STREAM = _Stream()


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda device=None: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext(stream)
    cuda.set_stream = lambda stream: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = _cpu_manual_seed


def _patch_megatron_rng() -> None:
    """Point mcore's private CUDA RNG getters/setters at the CPU generator (tracker add/fork)."""
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:  # megatron-core not installed: nothing to patch
        return

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


def _patch_megatron_recompute() -> None:
    """Activation recompute (``parallel.recompute: full``) re-runs the layers inside the autograd
    engine's backward, where this thread's torch-function mode is not in effect: megatron's default
    causal mask would then be made on ``device="cuda"``. Run the recompute under the mode too."""
    try:
        from megatron.core.tensor_parallel.random import CheckpointFunction
    except ImportError:  # megatron-core not installed: nothing to patch
        return
    original = CheckpointFunction.backward

    def backward(ctx: Any, *grads: Any) -> Any:
        with _CudaToCpuMode():
            return original(ctx, *grads)

    CheckpointFunction.backward = staticmethod(backward)


def _run_backward_under_mode(function: type) -> None:
    """Make ``function.backward`` (a ``torch.autograd.Function``) run under the device mapping; the
    autograd engine calls it where this thread's torch-function mode is not in effect."""
    if getattr(function.backward, "_hacrl_cpu_compat", False):
        return
    original = function.backward

    def backward(ctx: Any, *grads: Any) -> Any:
        with _CudaToCpuMode():
            return original(ctx, *grads)

    backward._hacrl_cpu_compat = True  # type: ignore[attr-defined]
    function.backward = staticmethod(backward)


def _patch_megatron_backward_allocations() -> None:
    """Sequence parallelism (TP > 1 with MoE) and expert parallelism allocate their gathered and
    reduce-scattered buffers with ``device=torch.cuda.current_device()`` inside the backward of the
    autograd functions of ``tensor_parallel/mappings.py`` and ``tensor_parallel/layers.py`` (the same
    cause as the recompute fix); run every such backward under the mode."""
    try:
        from megatron.core.tensor_parallel import layers, mappings
    except ImportError:  # megatron-core not installed: nothing to patch
        return
    for module in (mappings, layers):
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, torch.autograd.Function) and value.__module__ == module.__name__:
                _run_backward_under_mode(value)


def _patch_megatron_moe() -> None:
    """megatron-core's MoE layers without Transformer Engine on a CPU:

    * 0.16.1: ``moe_utils`` imports ``te_general_gemm`` only inside its TE ``try`` block and never
      defines it otherwise, so the router's gating GEMM raises ``NameError`` without TE; it is set
      to None, the fallback megatron's own code tests for (torch.mm).
    * both versions: the all-to-all dispatcher moves its split sizes to the host with
      ``maybe_move_tensor_to_cpu``, which converts CUDA tensors only, so on a CPU
      ``all_to_all_single`` got tensor split sizes; CPU tensors now become the same numpy arrays the
      CUDA path returns.
    """
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:  # megatron-core not installed (or without MoE): nothing to patch
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move


# --------------------------------------------------------------------------------------------
# the torch-function mode


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare ordinal means cuda:<n>
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _caller_frame() -> Any:
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("torch", __name__)):
        frame = frame.f_back
    return frame


def _log_site(what: str) -> None:
    frame = _caller_frame()
    if frame is None:
        return
    site = (frame.f_code.co_filename, frame.f_lineno)
    if site not in _LOGGED_SITES:
        _LOGGED_SITES.add(site)
        logger.warning("cpu_compat: %s at %s:%d", what, *site)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU and answers megatron's ``.type()`` checks."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            if _LOG:
                _log_site(f"{func.__name__}() kept on CPU")
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return self._type_name(args[0])
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            if _LOG:
                _log_site(f"{getattr(func, '__name__', func)}(device={kwargs['device']!r}) -> cpu")
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            if _LOG:
                _log_site(f"to({args[1]!r}) -> cpu")
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)

    @staticmethod
    def _type_name(tensor: torch.Tensor) -> str:
        real = torch.Tensor.type(tensor)
        frame = _caller_frame()
        caller = frame.f_globals.get("__name__", "") if frame is not None else ""
        if caller.startswith("megatron.") and tensor.device.type == "cpu" and tensor.dtype in _TYPE_NAMES:
            return _TYPE_NAMES[tensor.dtype]
        return real
