"""Small network helpers shared by test worlds, rollout servers and weight-update groups (standard library only)."""

from __future__ import annotations

import socket
import urllib.parse

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
