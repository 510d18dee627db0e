"""Where a node of a Slurm job gets its address (launch/node_address.py): the override, the
--socket-ifname interface, Slurm's NodeAddr (a stand-in ``scontrol`` here; tests/slurm asks a real
one), loopback for one node outside Slurm; a node without an address stops the job script with one
line naming it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hacrl_megatron.launch.executors import PACKAGE_ROOT
from hacrl_megatron.launch.node_address import (
    NodeAddressError,
    interface_addresses,
    node_address,
    select_interfaces,
)
from hacrl_megatron.launch.slurm_ray import ray_cluster_script

SHOW_NODE = {  # what `scontrol show node -o NAME` prints (22.05, shortened)
    "n1": "NodeName=n1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 NodeAddr=127.0.0.2 NodeHostName=n1 Port=6818",
    "byname": "NodeName=byname Arch=x86_64 NodeAddr=localhost NodeHostName=byname",
    "lost": "NodeName=lost Arch=x86_64 NodeAddr=no-such-host.invalid NodeHostName=lost",
}


@pytest.fixture
def scontrol(tmp_path) -> str:
    """A stand-in ``scontrol show node -o NAME``: the lines above, Slurm's error for any other node."""
    path = tmp_path / "scontrol"
    cases = "".join(f"  {name}) echo '{line}' ;;\n" for name, line in SHOW_NODE.items())
    path.write_text(f'#!/bin/bash\ncase "$4" in\n{cases}  *) echo "Node $4 not found" >&2; exit 1 ;;\nesac\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_slurm_nodeaddr_of_this_node(scontrol):
    assert node_address(env={"SLURMD_NODENAME": "n1"}, scontrol=scontrol) == "127.0.0.2"
    assert node_address(node="n1", env={}, scontrol=scontrol) == "127.0.0.2"
    assert node_address(env={"SLURMD_NODENAME": "byname"}, scontrol=scontrol) == "127.0.0.1"  # resolved


@pytest.mark.parametrize("node, words", [("lost", "its NodeAddr no-such-host.invalid does not resolve"),
                                         ("ghost", "Slurm reports no NodeAddr (Node ghost not found)")])
def test_a_node_without_an_address_is_named(scontrol, node, words):
    with pytest.raises(NodeAddressError, match=f"^node {node}: ") as err:
        node_address(env={"SLURMD_NODENAME": node}, scontrol=scontrol)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_override_wins_and_must_be_an_address(scontrol):
    env = {"SLURMD_NODENAME": "n1", "HACRL_RAY_NODE_IP": "127.0.0.9"}
    assert node_address(ifname="lo", env=env, scontrol=scontrol) == "127.0.0.9"
    with pytest.raises(NodeAddressError, match=r"node n1: HACRL_RAY_NODE_IP='n1\.ib' is not an IPv4 address"):
        node_address(env={**env, "HACRL_RAY_NODE_IP": "n1.ib"}, scontrol=scontrol)


def test_outside_slurm_only_a_one_node_job_has_an_address():
    assert node_address(env={}) == "127.0.0.1"
    assert node_address(env={"SLURM_NNODES": "1"}) == "127.0.0.1"
    with pytest.raises(NodeAddressError, match=r"not a Slurm node .* job of 2 nodes; set HACRL_RAY_NODE_IP"):
        node_address(env={"SLURM_NNODES": "2"})


@pytest.mark.parametrize("spec, chosen", [("ib", ["ib0", "ib1"]), ("=ib0", ["ib0"]), ("ib1,eth", ["eth0", "ib1"]),
                                          ("^docker,lo", ["eth0", "ib0", "ib1"]), ("^=ib0", ["lo", "eth0", "docker0",
                                                                                              "ib1"]), ("nope", [])])
def test_interfaces_selected_as_nccl_does(spec, chosen):
    assert select_interfaces(spec, ["lo", "eth0", "docker0", "ib0", "ib1"]) == chosen


def test_interface_address_is_read_from_the_kernel():
    addrs = interface_addresses()
    assert addrs.get("lo") == "127.0.0.1"
    assert node_address(ifname="lo", env={"SLURMD_NODENAME": "n1"}) == "127.0.0.1"  # the interface, not Slurm
    with pytest.raises(NodeAddressError, match="node n1: no interface with an IPv4 address matches --socket-ifname "
                                               "=hacrl_none0"):
        node_address(ifname="=hacrl_none0", env={"SLURMD_NODENAME": "n1"})


@pytest.mark.parametrize("nodeid", ["0", "1"])
def test_job_script_stops_with_one_line_naming_the_node(tmp_path, scontrol, nodeid):
    """Head or worker: a node Slurm has no address for ends its task at once (exit 1), before Ray."""
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "node.sh"
    script.write_text(ray_cluster_script(["true"], python=sys.executable, wait_timeout_s=30))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RAY_", "HACRL_RAY"))}
    env.update(PYTHONPATH=PACKAGE_ROOT, PATH=f"{Path(scontrol).parent}{os.pathsep}{env['PATH']}",
               SLURMD_NODENAME="ghost", SLURM_NODEID=nodeid, SLURM_NNODES="2", SLURM_JOB_ID="5")
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == ["[hacrl] node ghost: Slurm reports no NodeAddr (Node ghost not found)"]
    assert "starting the Ray head" not in out.stdout and not list(tmp_path.glob("ray_*"))
