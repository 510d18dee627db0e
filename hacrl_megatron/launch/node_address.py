"""The address a node of a Slurm job offers Ray and its servers: what the cluster says about the
node, never a guess from the host's routing table.

In order (:func:`node_address`):

1. ``$HACRL_RAY_NODE_IP``: set per node by the site (a TaskProlog, a wrapper), it wins;
2. ``--socket-ifname`` (NCCL's interface syntax: ``ib0``, ``ib``, ``=ib0``, ``^docker,lo``): the
   IPv4 address of the first interface it selects, the network NCCL and gloo use too;
3. Slurm: the ``NodeAddr`` of ``$SLURMD_NODENAME`` (``scontrol show node``), resolved when it is a
   host name (NodeAddr defaults to the node's name);
4. outside Slurm, a one-node job: 127.0.0.1 (nothing needs to reach it from elsewhere).

Anything else raises :class:`NodeAddressError`, whose one-line message names the node.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import socket
import struct
import subprocess
from collections.abc import Mapping

NODE_IP_ENV = "HACRL_RAY_NODE_IP"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


class NodeAddressError(RuntimeError):
    """This node has no usable address (the message names the node and where it looked)."""


def interface_addresses() -> dict[str, str]:
    """``{interface: IPv4 address}`` for every interface that has one, in the kernel's order."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def select_interfaces(spec: str, names: list[str]) -> list[str]:
    """The interfaces of ``names`` that NCCL's ``NCCL_SOCKET_IFNAME=spec`` selects: comma-separated
    prefixes, ``=`` for exact names, ``^`` to exclude the listed ones instead."""
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    parts = [p for p in (body[1:] if exact else body).split(",") if p]

    def listed(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in parts)

    return [n for n in names if listed(n) != exclude]


def _address_of_interfaces(spec: str, node: str) -> str:
    addrs = interface_addresses()
    chosen = select_interfaces(spec, list(addrs))
    if not chosen:
        raise NodeAddressError(f"node {node}: no interface with an IPv4 address matches --socket-ifname {spec} "
                               f"(interfaces with one: {', '.join(addrs) or 'none'})")
    return addrs[chosen[0]]


def slurm_node_addr(node: str, scontrol: str = "scontrol") -> str:
    """``NodeAddr`` of ``node`` as ``scontrol show node`` reports it (an address or a host name)."""
    try:
        out = subprocess.run([scontrol, "show", "node", "-o", node], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise NodeAddressError(f"node {node}: cannot ask Slurm for its NodeAddr ({scontrol}: {err})") from None
    match = re.search(r"(?:^|\s)NodeAddr=(\S+)", out.stdout)
    if out.returncode != 0 or not match:
        why = (out.stderr or out.stdout).strip().splitlines()
        raise NodeAddressError(f"node {node}: Slurm reports no NodeAddr ({why[-1] if why else 'empty answer'})")
    return match.group(1)


def _resolve(name: str, node: str) -> str:
    try:
        return str(ipaddress.IPv4Address(name))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as err:
        raise NodeAddressError(f"node {node}: its NodeAddr {name} does not resolve ({err})") from None
    return infos[0][4][0]


def node_address(*, ifname: str | None = None, node: str | None = None, env: Mapping[str, str] | None = None,
                 scontrol: str = "scontrol") -> str:
    """This node's IPv4 address (see the module docstring for the order). ``node``: the Slurm node
    name (default ``$SLURMD_NODENAME``); ``env``: the environment to read (default ``os.environ``)."""
    env = os.environ if env is None else env
    override = env.get(NODE_IP_ENV, "").strip()
    node = node or env.get("SLURMD_NODENAME") or ""
    label = node or socket.gethostname()
    if override:
        try:
            return str(ipaddress.IPv4Address(override))
        except ValueError:
            raise NodeAddressError(f"node {label}: {NODE_IP_ENV}={override!r} is not an IPv4 address") from None
    if ifname:
        return _address_of_interfaces(ifname, label)
    if node:
        return _resolve(slurm_node_addr(node, scontrol), node)
    nodes = env.get("SLURM_NNODES", "1")
    if nodes.strip() in ("", "1"):
        return "127.0.0.1"
    raise NodeAddressError(f"node {label}: not a Slurm node ($SLURMD_NODENAME unset) in a job of {nodes} nodes; "
                           f"set {NODE_IP_ENV} or --socket-ifname")
