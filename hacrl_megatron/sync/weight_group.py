"""The weight group's pieces, shared by the distributed transports (sync/distributed.py, sync/vllm_nccl.py):
the bucket format on the wire (the tensors' bytes concatenated in order, no padding) and the trainer's
side of the engines' group rendezvous (``init_method = tcp://master:port``, the store prefixed by the
group name, torch's process-group helper), for NCCL on GPUs and gloo on CPU.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch

from hacrl_megatron.net import bound_tcp_store

# --------------------------------------------------------------------------------------------
# the bucket format


def flatten_bucket(bucket: Sequence[tuple[str, torch.Tensor]],
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, dict[str, list]]:
    """(flat uint8 tensor [Σ bytes], {"names", "dtypes", "shapes"}) of one bucket.

    The bytes of each tensor (C order) follow each other without padding; ``dtypes`` are torch
    dtype names without the ``torch.`` prefix ("bfloat16"), as SGLang's receiver expects.
    """
    if not bucket:
        raise ValueError("flatten_bucket: empty bucket")
    parts = [t.detach().reshape(-1).view(torch.uint8) for _, t in bucket]
    flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
    if device is not None:
        flat = flat.to(device, non_blocking=False)
    meta = {"names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}
    return flat, meta


def unflatten_bucket(flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[str],
                     shapes: Sequence[Sequence[int]]) -> list[tuple[str, torch.Tensor]]:
    """The receiver's side of :func:`flatten_bucket`: views of ``flat`` as the named tensors."""
    out, offset = [], 0
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dtype_name)
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        if offset % dtype.itemsize:
            raise ValueError(f"unflatten_bucket: {name!r} ({dtype_name}) starts at unaligned byte {offset}")
        out.append((name, flat[offset: offset + size].view(dtype).reshape(shape)))
        offset += size
    if offset != flat.numel():
        raise ValueError(f"unflatten_bucket: shapes cover {offset} bytes, the bucket has {flat.numel()}")
    return out


# --------------------------------------------------------------------------------------------
# the process group


def init_weight_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str, timeout_s: float = 600.0) -> Any:
    """Join the weight-update group as ``rank`` (0 = the trainer, which hosts the TCP store).

    Mirrors SGLang's ``init_weights_update_group`` rendezvous so that both sides meet: a TCP store
    at ``master_address:master_port``, keys prefixed by ``group_name``, then torch's own
    ``"<name>/"`` and ``"<device>/"`` prefixes. Rank 0's store listens on ``master_address`` only
    (not every interface), and with gloo its sockets bind that address too, so an engine that was
    handed another node's address is refused instead of reaching a listener by accident. nccl
    groups are built by torch's process-group helper (NCCL picks its interface itself,
    ``NCCL_SOCKET_IFNAME``), registered so that ``dist.broadcast`` maps group ranks to themselves.
    No default process group is needed.
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = bound_tcp_store(master_address, master_port, world_size, True, timeout)
    else:
        store, _, _ = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    if backend == "gloo":
        bind = master_address if rank == 0 else ""
        keys = c10d.PrefixStore("cpu/", c10d.PrefixStore(f"{group_name}/", c10d.PrefixStore(group_name, store)))
        return gloo_group(keys, rank, world_size, timeout, bind)
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                              c10d.PrefixStore(group_name, store), group_name=group_name,
                                              timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def gloo_group(store: Any, rank: int, world_size: int, timeout: datetime.timedelta, bind_address: str = "") -> Any:
    """A gloo process group (torch's ``ProcessGroupGloo``) whose sockets bind ``bind_address``
    (a host name or address; "" = gloo's default: ``GLOO_SOCKET_IFNAME``, else the host name)."""
    import torch.distributed as dist

    if not bind_address:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_address)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def destroy_weight_group(group: Any) -> None:
    """Leave a group from :func:`init_weight_group` (a gloo group closes its sockets when dropped)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if group in c10d._world.pg_group_ranks:  # built by torch's helper (nccl)
        dist.destroy_process_group(group)


def broadcast_async(group: Any, tensor: torch.Tensor) -> Any:
    """Start a broadcast from group rank 0; returns torch's Work."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)
