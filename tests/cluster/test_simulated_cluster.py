"""Many hosts on one machine: a Ray cluster whose nodes each have their own loopback address.

Ray's ``cluster_utils.Cluster`` starts a head node on 127.0.0.2 (the controller's, no GPUs) and two
"GPU nodes" on 127.0.0.3 and 127.0.0.4 (fake GPU resources). Each agent's SGLang stand-in servers
(tests/fixtures/fake_sglang_server.py, the real request contract, an HF model behind it) are owned by
Ray actors on the GPU nodes (``rollout.sglang.placement: ray``) and bind their node's address only,
so a client that used 127.0.0.1 or another node's address would be refused. The controller trains
two tiny agents through the real loop: rollout from the remote engines, disk weight sync into them
and the post-sync log-prob check after every step; then one engine's server is killed on its node
and the pool restarts it through its actor and resyncs it.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

from hacrl_megatron.config import validate
from hacrl_megatron.trainer import loop
from tests.e2e.test_trainer import run_with, tiny_exp

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

HEAD, GPU_NODES = "127.0.0.2", ("127.0.0.3", "127.0.0.4")
FAKE_SERVER = Path(__file__).resolve().parents[1] / "fixtures" / "fake_sglang_server.py"


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "node_ip_address": HEAD})
    for ip in GPU_NODES:
        c.add_node(num_cpus=2, num_gpus=2, node_ip_address=ip)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def cluster_exp(tmp_path: Path, steps: int = 2):
    exp = tiny_exp(tmp_path, steps=steps)
    command = [sys.executable, str(FAKE_SERVER), "--model-path", "{model_path}", "--host", "{host}", "--port", "{port}",
               "--enable-deterministic-inference"]
    rollout = dataclasses.replace(exp.rollout, engine="sglang", weight_sync="disk",
                                  sglang=dataclasses.replace(exp.rollout.sglang, placement="ray", command=command))
    agents = [dataclasses.replace(a, rollout_gpu_ids=[0, 1]) for a in exp.agents]  # two TP1 engines per agent
    return validate(dataclasses.replace(exp, rollout=rollout, agents=agents))


def refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return False
    except OSError:
        return True


def test_two_agents_train_with_engines_on_other_nodes(cluster, tmp_path):
    exp = cluster_exp(tmp_path)
    run, history = run_with(exp)
    try:
        nodes = set()
        for rt in run.runtimes:
            for client in (slot.engine for slot in rt.engine.slots):
                url = urlparse(client.base_url)
                info = client.server.node()
                assert url.hostname == info["ip"] and url.hostname in GPU_NODES  # bound to its own node
                assert refused("127.0.0.1", url.port)  # nothing listens on loopback's usual address
                other = next(ip for ip in GPU_NODES if ip != url.hostname)
                assert refused(other, url.port) and refused(HEAD, url.port)
                nodes.add(url.hostname)
        assert nodes == set(GPU_NODES)  # SPREAD: the engines use both GPU nodes
        for metrics in history:  # disk sync into the remote engines, checked against the trainer each step
            for name in ("llama", "qwen3"):
                assert metrics[f"{name}/sync_logp_diff"] < 1e-3 * 8
                assert metrics[f"{name}/rollout_tokens_total"] > 0

        # a GPU node loses an engine: the pool restarts it through its actor, on the same node, and resyncs it
        rt = run.runtimes[0]
        victim = rt.engine.slots[0].engine
        node_before = victim.server.node()["node_id"]
        victim.server.kill_server()
        metrics = loop.train_step(run)
        assert victim.server.restarts == 1 and victim.server.node()["node_id"] == node_before
        assert metrics["llama/sync_logp_diff"] < 1e-3 * 8
    finally:
        for rt in run.runtimes:
            rt.close()
    assert ray.util.placement_group_table() and all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
