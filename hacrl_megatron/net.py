"""Small network helpers shared by test worlds, rollout servers and weight-update groups.

Standard library only at import; torch is imported by the store helper when it runs, and Ray is
consulted only when this process has already joined a Ray cluster.
"""

from __future__ import annotations

import datetime
import socket
import sys
import urllib.parse
from typing import Any

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it).

    ``host`` is the address the caller will listen on: ``"127.0.0.1"`` for a server or world on
    this machine, ``""`` (every interface) for a store that engines on other nodes connect to.
    Another process may take the port before the caller binds it; callers that can rendezvous
    without a port (a file) should.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def local_address_towards(url: str) -> str:
    """This host's address as seen from the host of ``url`` (the interface that routes there).

    A loopback ``url`` gives 127.0.0.1; any other host is asked of the routing table (a UDP
    ``connect`` sends nothing, it only picks the route), so an engine on another node gets the
    address of the interface that reaches it.
    """
    host = urllib.parse.urlparse(url).hostname or "127.0.0.1"
    if host in LOOPBACK_HOSTS:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def node_address_towards(url: str) -> str:
    """The address a server on the host of ``url`` should use to reach a listener in this process.

    A loopback ``url`` gives 127.0.0.1. In a process that has joined a Ray cluster it is this
    node's address as Ray knows it (``ray.util.get_node_ip_address()``): on a cluster each node has
    its own address even where, as in a cluster simulated on one machine, the routing table would
    answer 127.0.0.1 for all of them. Otherwise the interface that routes to the host
    (:func:`local_address_towards`).
    """
    host = urllib.parse.urlparse(url).hostname or "127.0.0.1"
    if host in LOOPBACK_HOSTS:
        return "127.0.0.1"
    ray = sys.modules.get("ray")  # never imported here: only a process already in a cluster asks Ray
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return str(ray.util.get_node_ip_address())
    return local_address_towards(url)


def bound_tcp_store(host: str, port: int, world_size: int, is_master: bool,
                    timeout: datetime.timedelta) -> Any:
    """A ``torch.distributed.TCPStore`` at ``host:port``; the master's server listens on ``host`` only.

    torch's own store server binds every interface; here the master binds a socket to ``host``
    and hands it over (``master_listen_fd``), so a store meant for loopback is not on the network
    and a store on a node's address refuses clients that took another node's address.
    """
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for the torch.distributed store: {err}") from err
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.detach())
