"""Pickling CUDA tensors for another process that numbers its GPUs differently.

torch's reducer for a CUDA tensor (``torch.multiprocessing.reductions.reduce_tensor``) records the
*integer* device index of the sender. An SGLang server launched with its own
``CUDA_VISIBLE_DEVICES`` (:class:`~hacrl_megatron.rollout.sglang_server.SGLangServer` sets it)
numbers the same GPU differently, so torch's rebuild would open the IPC handle on the wrong device.
A GPU's UUID is the same in every process. So:

- the sender (:func:`dumps_named_tensors`) pickles with a reducer that replaces the device index
  by the GPU's UUID, and keeps torch's ``rebuild_cuda_tensor`` as the rebuild function — the
  only CUDA rebuild function SGLang's restricted unpickler accepts;
- the receiver maps the UUID back to its local index before rebuilding: SGLang's server patches
  ``rebuild_cuda_tensor`` to do that before it deserializes (``utils/patch_torch.py``, every
  0.5.x release); our own receivers (:func:`loads_named_tensors`: tests, the stand-in server) use
  :func:`rebuild_cuda_tensor_by_uuid`.

The payload format is SGLang's ``MultiprocessingSerializer``: base64 of a ``ForkingPickler``
pickle of ``[(name, tensor), ...]``. CPU tensors keep torch's shared-memory reducers.
"""

from __future__ import annotations

import base64
import inspect
import io
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _reductions() -> Any:
    from torch.multiprocessing import reductions  # importing registers torch's reducers with ForkingPickler

    return reductions


def _device_arg_position() -> int:
    """Index of ``storage_device`` among the arguments of torch's ``rebuild_cuda_tensor``."""
    params = list(inspect.signature(_reductions().rebuild_cuda_tensor).parameters)
    if "storage_device" not in params:
        raise RuntimeError(f"torch {torch.__version__}: rebuild_cuda_tensor has no storage_device argument "
                           f"({params}); the UUID reducer in hacrl_megatron/sync/cuda_ipc.py needs updating")
    return params.index("storage_device")


def device_uuid(index: int) -> str:
    """The UUID of local CUDA device ``index`` (the same string in every process on the node)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(uuid: str) -> int:
    """The local index of the CUDA device with ``uuid``; ValueError if this process cannot see it."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise ValueError(f"no visible CUDA device has uuid {uuid!r} ({torch.cuda.device_count()} visible; "
                     "CUDA_VISIBLE_DEVICES of the receiver must include the sender's GPU)")


def reduce_tensor_by_uuid(tensor: torch.Tensor, *, base_reduce: Callable | None = None,
                          uuid_of: Callable[[int], str] = device_uuid) -> tuple[Callable, tuple]:
    """torch's reduction of ``tensor`` with the device index of a CUDA tensor replaced by its UUID.

    ``base_reduce`` (torch's ``reduce_tensor`` by default) and ``uuid_of`` are parameters so that
    the rewrite can be checked on a machine without CUDA.
    """
    reductions = _reductions()
    fn, args = (base_reduce or reductions.reduce_tensor)(tensor)
    if fn is not reductions.rebuild_cuda_tensor:
        return fn, args  # CPU (shared memory), meta, sparse: no device index to rewrite
    pos = _device_arg_position()
    if not isinstance(args[pos], int):
        raise TypeError(f"reduce_tensor_by_uuid: expected an integer device at argument {pos}, got {args[pos]!r}")
    return fn, (*args[:pos], uuid_of(args[pos]), *args[pos + 1:])


def rebuild_cuda_tensor_by_uuid(*args: Any, base_rebuild: Callable | None = None,
                                index_of: Callable[[str], int] = device_index) -> torch.Tensor:
    """torch's ``rebuild_cuda_tensor`` after mapping a UUID device argument to the local index."""
    pos = _device_arg_position()
    if isinstance(args[pos], str):
        args = (*args[:pos], index_of(args[pos]), *args[pos + 1:])
    return (base_rebuild or _reductions().rebuild_cuda_tensor)(*args)


def _uuid_pickler_class(reduce: Callable[[torch.Tensor], tuple]) -> type:
    from multiprocessing.reduction import ForkingPickler

    _reductions()

    class UUIDPickler(ForkingPickler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            table = dict(self.dispatch_table)
            table[torch.Tensor] = reduce
            table[torch.nn.Parameter] = reduce
            self.dispatch_table = table

    return UUIDPickler


def dumps_named_tensors(tensors: Sequence[tuple[str, torch.Tensor]], *,
                        reduce: Callable[[torch.Tensor], tuple] = reduce_tensor_by_uuid) -> str:
    """base64 ``ForkingPickler`` pickle of ``[(name, tensor)]`` with CUDA devices named by UUID.

    The caller must keep the tensors alive until the receiver has copied them (the HTTP call that
    carries the payload returns after the server loaded the weights).
    """
    from hacrl_megatron.sockets import use_short_multiprocessing_dir

    use_short_multiprocessing_dir()  # a CPU tensor's fd goes over a Unix socket in multiprocessing's folder
    buf = io.BytesIO()
    _uuid_pickler_class(reduce)(buf, pickle.HIGHEST_PROTOCOL).dump([(str(n), t) for n, t in tensors])
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _ReceivingUnpickler(pickle.Unpickler):
    """Resolves torch's ``rebuild_cuda_tensor`` to the UUID-aware rebuild (any other global as usual)."""

    def __init__(self, file: io.BytesIO, rebuild: Callable) -> None:
        super().__init__(file)
        self._rebuild = rebuild

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return self._rebuild
        return super().find_class(module, name)


def loads_named_tensors(payload: str, *, rebuild: Callable = rebuild_cuda_tensor_by_uuid) -> list[tuple[str, Any]]:
    """Inverse of :func:`dumps_named_tensors` in the receiving process (CUDA tensors land on the
    local index of the sender's GPU)."""
    _reductions()
    return _ReceivingUnpickler(io.BytesIO(base64.b64decode(payload)), rebuild).load()
