"""Single-node worlds listen on loopback only (item 15): the torch.distributed rendezvous store and
gloo's sockets of a world on one machine, Ray agents' worlds on one node, and a private Ray cluster.
Multi-node worlds keep rank 0's address (docs/security.md states the trust assumption)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from hacrl_megatron.agents.ray_placement import rank_envs
from hacrl_megatron.models.parallel import free_port, is_loopback

LOOPBACK_HOSTS = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _listeners_of_world(env: dict[str, str], world: int) -> list[list[str]]:
    """Start ``world`` processes that join one env:// world through ``init_parallel``; each returns
    the local addresses its process listens on once the world (and megatron's groups) exist."""
    script = textwrap.dedent("""
        import json, os, sys, warnings
        warnings.filterwarnings("ignore")
        import psutil, torch
        torch.set_num_threads(1)
        from hacrl_megatron.models.parallel import init_parallel, shutdown_parallel
        init_parallel(tp=int(os.environ["WORLD_SIZE"]))
        me = psutil.Process()
        print(json.dumps(sorted({c.laddr.ip for c in me.net_connections("inet") if c.status == "LISTEN"})))
        shutdown_parallel()
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def test_single_node_ray_world_meets_on_loopback_and_multi_node_on_rank_0():
    one_node = [{"ip": "10.1.2.3", "gpu_ids": []}, {"ip": "10.1.2.3", "gpu_ids": []}]
    assert {e["MASTER_ADDR"] for e in rank_envs(one_node, "10.1.2.3", 29500)} == {"127.0.0.1"}
    two_nodes = [{"ip": "10.1.2.3", "gpu_ids": []}, {"ip": "10.1.2.4", "gpu_ids": []}]
    assert {e["MASTER_ADDR"] for e in rank_envs(two_nodes, "10.1.2.3", 29500)} == {"10.1.2.3"}


def test_is_loopback():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.1.1", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("10.0.0.1", "0.0.0.0", "node-3", ""))


@pytest.mark.distributed
def test_two_rank_world_on_loopback_listens_on_loopback_only():
    pytest.importorskip("megatron.core")
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"})
    listeners = _listeners_of_world(env, 2)
    assert listeners[0], "rank 0 must at least serve the rendezvous store"
    for rank, addrs in enumerate(listeners):
        assert set(addrs) <= LOOPBACK_HOSTS, f"rank {rank} listens on {addrs}"  # torch's default: '::' / '*'


@pytest.mark.slow
def test_private_ray_cluster_listens_on_loopback_only():
    pytest.importorskip("ray")
    short_tmp = tempfile.mkdtemp(prefix="hr", dir="/tmp")  # Ray's socket paths must stay < 108 bytes
    script = textwrap.dedent("""
        import json, psutil
        from hacrl_megatron.agents.ray_placement import ensure_ray
        ray = ensure_ray(num_cpus=1)
        ip = ray.util.get_node_ip_address()
        procs = [psutil.Process()] + psutil.Process().children(recursive=True)
        addrs = set()
        for p in procs:
            try:
                addrs |= {c.laddr.ip for c in p.net_connections("inet") if c.status == "LISTEN"}
            except psutil.Error:
                pass
        ray.shutdown()
        print(json.dumps({"ip": ip, "listen": sorted(addrs)}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = short_tmp  # no /tmp/ray/ray_current_cluster of another cluster to join
    try:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(short_tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ip"] == "127.0.0.1"
    assert result["listen"] and set(result["listen"]) <= LOOPBACK_HOSTS, result["listen"]
