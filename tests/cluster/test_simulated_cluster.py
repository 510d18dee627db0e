"""Many hosts on one machine: a Ray cluster whose nodes each have their own loopback address.

Ray's ``cluster_utils.Cluster`` starts a job laid out like the Slurm script's: a head node on
127.0.0.2 (the controller's; like every node of a launched job it offers its GPUs) and three more
nodes on 127.0.0.3-5, two fake GPU resources each (torch sees no CUDA there, so ranks use gloo and
servers compute on CPU); node k carries the script's ``hacrl_node_<k>`` resource and
``$HACRL_GPUS_PER_NODE`` is 2, so trainers and engines go where the plan puts them. Every server binds its own node's address: the SGLang stand-in
servers (tests/fixtures/fake_sglang_server.py, the real request contract, an HF model behind it)
are owned by Ray actors on GPU nodes (``rollout.sglang.placement: ray``), and the weight-update
group's store and gloo sockets listen on the trainer's node address; a client that used 127.0.0.1
or another node's address is refused.

Two scenarios through the real loop (rollout, verification, π_old, training, weight sync and the
post-sync log-prob check every step):

- the 70B preset's topology scaled down: each agent's Megatron trainer is a Ray world of two ranks
  (TP = 2) filling one GPU node, its engine runs on a node that is neither the controller's nor its
  trainer's, and weights go by ``distributed`` broadcast from trainer rank 0 across nodes; one
  agent starts from an HF folder that the controller never loads (ranks read their shards, the
  engine loads the folder). A killed engine actor is replaced on its node and resynced.
- HF trainers on the controller with two engines per agent on distinct nodes and disk sync; an
  engine's server killed on its node is restarted through its actor.

A world of ranks on one node meets on that node's loopback address (models/parallel.py: nothing of
it listens on the network); only addresses that cross nodes are node addresses.
"""

from __future__ import annotations

import dataclasses
import os
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

HEAD, GPU_NODES = "127.0.0.2", ("127.0.0.3", "127.0.0.4", "127.0.0.5")
FAKE_SERVER = Path(__file__).resolve().parents[1] / "fixtures" / "fake_sglang_server.py"


def node_resources(k: int) -> dict[str, float]:
    """Node k's Ray resources as the Slurm script sets them: its own ``RAY_ARGS`` line run by bash
    with ``SLURM_NODEID``'s value, the ``--resources=`` JSON read back."""
    import json
    import subprocess

    from hacrl_megatron.launch.slurm_ray import ray_cluster_script

    line = next(x for x in ray_cluster_script(["true"]).splitlines() if x.startswith("RAY_ARGS=("))
    out = subprocess.run(["bash", "-c", f'NODEID={k}\n{line}\nprintf "%s\\n" "${{RAY_ARGS[@]}}"'],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    return json.loads(next(a for a in out if a.startswith("--resources=")).split("=", 1)[1])


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    from tests.cluster.conftest import node_wait_s

    previous = os.environ.get("HACRL_GPUS_PER_NODE")
    os.environ["HACRL_GPUS_PER_NODE"] = "2"  # exported by the Slurm script
    # like a launched job: the head (node 0) offers its GPUs too; node k carries hacrl_node_<k>
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "node_ip_address": HEAD,
                                                      "resources": node_resources(0)})
    for k, ip in enumerate(GPU_NODES, start=1):
        c.add_node(num_cpus=2, num_gpus=2, node_ip_address=ip, resources=node_resources(k))
    c.wait_for_nodes(timeout=node_wait_s())
    # Ray's Cluster records its head as the machine's "current cluster" (ray_current_cluster in Ray's temp
    # dir), which every `ray.init()` without an address then joins: a `hacrl train` run by another test at
    # the same time (CI's other lane) would land on these nodes. This module connects by address only.
    from ray._common.utils import reset_ray_address

    reset_ray_address()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if previous is None:
            os.environ.pop("HACRL_GPUS_PER_NODE", None)
        else:
            os.environ["HACRL_GPUS_PER_NODE"] = previous


def cluster_exp(tmp_path: Path, steps: int = 2):
    """HF trainers on the controller; two TP1 engines per agent on job-wide GPUs (node · 2 + local):
    llama on nodes 1 and 2, qwen3 on nodes 3 and 1."""
    exp = tiny_exp(tmp_path, steps=steps)
    command = [sys.executable, str(FAKE_SERVER), "--model-path", "{model_path}", "--host", "{host}", "--port", "{port}",
               "--enable-deterministic-inference"]
    rollout = dataclasses.replace(exp.rollout, engine="sglang", weight_sync="disk",
                                  sglang=dataclasses.replace(exp.rollout.sglang, placement="ray", command=command))
    agents = [dataclasses.replace(a, rollout_gpu_ids=ids) for a, ids in zip(exp.agents, ([2, 4], [6, 3]))]
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
        for rt in run.runtimes:
            for client in (slot.engine for slot in rt.engine.slots):
                url = urlparse(client.base_url)
                info = client.server.node()
                assert url.hostname == info["ip"] and url.hostname in GPU_NODES  # bound to its own node
                assert refused("127.0.0.1", url.port)  # nothing listens on loopback's usual address
                assert all(refused(ip, url.port) for ip in (*GPU_NODES, HEAD) if ip != url.hostname)
            assert len({urlparse(slot.engine.base_url).hostname for slot in rt.engine.slots}) == 2  # SPREAD
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


def megatron_cluster_exp(tmp_path: Path, steps: int = 2):
    """Two Megatron agents, TP = 2 each (a Ray world of two ranks filling one 2-GPU node: the plan puts
    llama on node 1, qwen3 on node 2), one TP1 engine each on node 3 (``rollout_gpu_ids`` 6 and 7),
    distributed weight sync; llama starts from an HF folder."""
    from hacrl_megatron.exchange.tokenizers import load_tokenizer
    from hacrl_megatron.trainer.runtime import load_hf_model

    exp = tiny_exp(tmp_path, backend="megatron", steps=steps)
    llama = exp.agents[0]
    tokenizer = load_tokenizer(llama.tokenizer)
    folder = tmp_path / "llama-hf"
    load_hf_model(llama, len(tokenizer), seed=7).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    command = [sys.executable, str(FAKE_SERVER), "--model-path", "{model_path}", "--host", "{host}", "--port", "{port}",
               "--enable-deterministic-inference"]
    rollout = dataclasses.replace(exp.rollout, engine="sglang", weight_sync="distributed",
                                  sglang=dataclasses.replace(exp.rollout.sglang, placement="ray", command=command))
    agents = [dataclasses.replace(a, workers="ray", rollout_gpu_ids=[gpu],
                                  parallel=dataclasses.replace(a.parallel, tp=2)) for a, gpu in zip(exp.agents, (6, 7))]
    agents[0] = dataclasses.replace(agents[0], model=dataclasses.replace(agents[0].model, hf_path=str(folder)))
    return validate(dataclasses.replace(exp, rollout=rollout, agents=agents)), folder


def listening(pid: int) -> set[tuple[str, int]]:
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


@pytest.mark.timeout(1800)  # four Megatron ranks and two servers start on 2 cores: ~3 min idle, far more under load
def test_megatron_trainers_and_engines_on_distinct_nodes_sync_across_nodes(cluster, tmp_path):
    exp, folder = megatron_cluster_exp(tmp_path)
    run, history = run_with(exp)
    try:
        trainer_nodes = []
        for rt in run.runtimes:
            ranks = rt.trainer.placement
            nodes = {r["ip"] for r in ranks}
            assert len(ranks) == 2 and len(nodes) == 1 and nodes <= set(GPU_NODES)  # the trainer fills one node
            (trainer_node,) = nodes
            trainer_nodes.append(trainer_node)
            (slot,) = rt.engine.slots
            engine_node = urlparse(slot.engine.base_url).hostname
            assert engine_node in GPU_NODES and engine_node != trainer_node  # neither the controller's nor its trainer's
            # rank 0 keeps the weight-update group with its engine between pushes: what closing the group
            # takes away (its store and gloo sockets) listened on the trainer's node address only
            with_group = listening(ranks[0]["pid"])
            rt.engine.transport.close()  # the next push opens a fresh group
            group_sockets = with_group - listening(ranks[0]["pid"])
            assert group_sockets and {ip for ip, _ in group_sockets} == {trainer_node}, (group_sockets, with_group)
        assert len(set(trainer_nodes)) == 2
        for metrics in history:  # broadcast from trainer rank 0 into the engine on another node, checked each step
            for name in ("llama", "qwen3"):
                assert metrics[f"{name}/sync_logp_diff"] < 1e-4, metrics[f"{name}/sync_logp_diff"]
                assert metrics[f"{name}/rollout_tokens_total"] > 0
        # llama's engine loads the HF folder itself (linked, in its own dtype), not a copy the controller wrote
        init = Path(exp.output_dir) / "engines" / "llama" / "init"
        assert (init / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()

        # an engine actor dies with its server: a new actor on the same bundle (node, GPUs, port) takes
        # over, the group is rebuilt at the next push and the engine is resynced
        rt = run.runtimes[1]
        victim = rt.engine.slots[0].engine
        node_before, url_before = victim.server.node()["node_id"], victim.base_url
        victim.server.kill_actor()
        metrics = loop.train_step(run)
        assert victim.server.restarts == 1 and victim.server.node()["node_id"] == node_before
        assert victim.base_url == url_before
        assert metrics["qwen3/sync_logp_diff"] < 1e-4
    finally:
        for rt in run.runtimes:
            rt.close()


@pytest.mark.timeout(1800)  # four Megatron ranks and two servers start on 2 cores
def test_colocated_servers_follow_the_trainer_ranks_onto_their_nodes(cluster, tmp_path):
    """rollout.colocate with placement ray across nodes (docs/colocation.md): each agent's TP2 world fills
    one GPU node and its TP2 server starts on that node, on the ranks' GPUs, without a bundle of its own;
    the ranks sleep (colocate_offload=all) while it generates, and the weights come by disk."""
    exp, _ = megatron_cluster_exp(tmp_path)
    command = [*exp.rollout.sglang.command, "--tp-size", "2"]
    rollout = dataclasses.replace(exp.rollout, colocate=True, weight_sync="auto", colocate_offload="all",
                                  sglang=dataclasses.replace(exp.rollout.sglang, tp=2, command=command))
    agents = [dataclasses.replace(a, rollout_gpu_ids=[]) for a in exp.agents]
    exp = validate(dataclasses.replace(exp, rollout=rollout, agents=agents))
    run, history = run_with(exp)
    try:
        for rt in run.runtimes:
            (trainer_node,) = {r["ip"] for r in rt.trainer.placement}
            (slot,) = rt.engine.slots
            assert urlparse(slot.engine.base_url).hostname == trainer_node  # the server shares its trainer's node
            assert slot.engine.server._group is None  # no bundle of its own: the GPUs are the ranks'
        for metrics in history:
            for name in ("llama", "qwen3"):
                assert metrics[f"{name}/sync_logp_diff"] < 1e-4, metrics[f"{name}/sync_logp_diff"]
                assert metrics[f"{name}/trainer/offload_mib"] > 0  # every rank slept while its server generated
        assert run.colocation.turn == "generation"
    finally:
        for rt in run.runtimes:
            rt.close()


def test_engines_go_to_the_nodes_the_planner_chose(cluster, tmp_path, monkeypatch):
    """Job-wide rollout_gpu_ids (node · gpus_per_node + local id) place each engine on its planned node."""
    from hacrl_megatron.exchange.tokenizers import load_tokenizer
    from hacrl_megatron.rollout.sglang_server import start_engines
    from hacrl_megatron.trainer.runtime import load_hf_model

    monkeypatch.setenv("HACRL_GPUS_PER_NODE", "2")
    exp = cluster_exp(tmp_path)
    cfg = dataclasses.replace(exp.agents[0], rollout_gpu_ids=[6, 2])  # node 3 (127.0.0.5), then node 1 (127.0.0.3)
    tok = load_tokenizer(cfg.tokenizer)
    started = start_engines(exp, cfg, load_hf_model(cfg, len(tok), seed=0), tok, tmp_path / "engines")
    try:
        assert [urlparse(c.base_url).hostname for c in started.clients] == ["127.0.0.5", "127.0.0.3"]
    finally:
        for c in started.clients:
            c.close()


def planned_job_exp(tmp_path: Path, steps: int = 2):
    """The plan on this 4 × 2-GPU job (launch/placement.node_plan): llama's trainer (1 rank) on node 1
    GPU 0; qwen3's (TP2) on node 1 GPU 1 and node 2 GPU 0, a TP group over two nodes; one TP2 engine
    each, llama's on node 0 (GPUs 0-1, the controller's node), qwen3's on node 3 (GPUs 6-7);
    distributed weight sync into both TP2 engines (one group member per engine rank)."""
    exp = tiny_exp(tmp_path, backend="megatron", steps=steps)
    command = [sys.executable, str(FAKE_SERVER), "--model-path", "{model_path}", "--host", "{host}", "--port", "{port}",
               "--enable-deterministic-inference", "--tp-size", "2"]
    rollout = dataclasses.replace(exp.rollout, engine="sglang", weight_sync="distributed",
                                  sglang=dataclasses.replace(exp.rollout.sglang, placement="ray", command=command, tp=2))
    agents = [dataclasses.replace(a, workers="ray", rollout_gpu_ids=ids, parallel=dataclasses.replace(a.parallel, tp=tp))
              for a, tp, ids in zip(exp.agents, (1, 2), ([0, 1], [6, 7]))]
    return validate(dataclasses.replace(exp, rollout=rollout, agents=agents))


NODE_IP = {0: HEAD, **{k: ip for k, ip in enumerate(GPU_NODES, start=1)}}


@pytest.mark.timeout(1800)  # three Megatron ranks and two servers start on 2 cores
def test_slurm_like_job_places_trainers_and_engines_as_planned(cluster, tmp_path):
    from hacrl_megatron.launch.placement import node_plan

    exp = planned_job_exp(tmp_path)
    plan = node_plan(exp, 4, 2)
    assert [a.spans for a in plan.agents] == [((1, 0, 1),), ((1, 1, 1), (2, 0, 1))]
    run, history = run_with(exp)
    try:
        for rt, planned in zip(run.runtimes, plan.agents):
            ranks = [NODE_IP[node] for node, _, count in planned.spans for _ in range(count)]
            assert [r["ip"] for r in rt.trainer.placement] == ranks, rt.name  # per rank, in rank order
            engines = [NODE_IP[e.node] for e in planned.engines]
            assert [urlparse(slot.engine.base_url).hostname for slot in rt.engine.slots] == engines, rt.name
            assert all(slot.engine.tp_size == 2 for slot in rt.engine.slots)
        assert [r["ip"] for r in run.runtimes[1].trainer.placement] == ["127.0.0.3", "127.0.0.4"]  # TP2 over 2 nodes
        for metrics in history:  # broadcast into both ranks of each TP2 engine, checked every step
            for name in ("llama", "qwen3"):
                assert metrics[f"{name}/sync_logp_diff"] < 1e-4, metrics[f"{name}/sync_logp_diff"]
                assert metrics[f"{name}/rollout_tokens_total"] > 0
    finally:
        for rt in run.runtimes:
            rt.close()


def test_unsatisfiable_planned_placement_fails_in_one_line_and_leaves_nothing(cluster, tmp_path, monkeypatch):
    """A group holding node 3's GPUs: engines planned there fail within the bounded wait, naming the
    agent, the node and the group that holds it; nothing of theirs stays placed."""
    from ray.util.placement_group import placement_group

    from hacrl_megatron.exchange.tokenizers import load_tokenizer
    from hacrl_megatron.rollout.sglang_server import start_engines
    from hacrl_megatron.trainer.runtime import load_hf_model

    monkeypatch.setenv("HACRL_PLACEMENT_TIMEOUT_S", "5")
    blocker = placement_group([{"GPU": 2.0, "hacrl_node_3": 1.0}], strategy="STRICT_PACK", name="blocker")
    assert blocker.wait(timeout_seconds=60)
    exp = cluster_exp(tmp_path)
    cfg = dataclasses.replace(exp.agents[0], rollout_gpu_ids=[6])  # node 3
    tok = load_tokenizer(cfg.tokenizer)
    try:
        with pytest.raises(RuntimeError) as err:
            start_engines(exp, cfg, load_hf_model(cfg, len(tok), seed=0), tok, tmp_path / "engines")
        assert str(err.value) == ("agent 'llama': engines planned on node 3 not placed within 5 s: node 3 (127.0.0.5): "
                                  "0 of 2 GPUs free, held by blocker (2 GPUs)")
    finally:
        ray.util.remove_placement_group(blocker)


def wait_refused(host: str, port: int, timeout_s: float = 60.0) -> None:
    """Until nothing answers at host:port (a removed node's server is ended by its guard)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not refused(host, port):
        assert time.monotonic() < deadline, f"{host}:{port} still answers {timeout_s:g} s after its node left"
        time.sleep(0.5)


@pytest.mark.timeout(1800)
def test_losing_an_engine_node_retires_its_engine_and_a_resume_finishes(cluster, tmp_path, caplog):
    """Node 2 (127.0.0.4) leaves the cluster in the middle of step 2's rollout, as llama's engine1
    there is sent its share: the step and the next go on with the surviving engines (its prompts
    redone on engine0), the engine is retired with one warning naming the agent, the engine and the
    node, and no other engine restarts; once the node is back (same address, same hacrl_node_2
    resource) a resume from the step-1 checkpoint finishes."""
    from hacrl_megatron.reward.pool import VerifierPool
    from tests.cluster.conftest import node_wait_s
    from tests.e2e.test_trainer import parity_reward

    exp = cluster_exp(tmp_path, steps=3)
    exp = dataclasses.replace(exp, checkpoint=dataclasses.replace(exp.checkpoint, every=1))
    run = loop.setup(exp)
    run.verifier.close()
    run.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
    (node2,) = [n for n in cluster.list_all_nodes() if n.node_ip_address == "127.0.0.4"]
    removed = False
    try:
        loop.train_step(run)
        loop._save(run)
        llama = run.runtimes[0].engine
        victim = llama.slots[1]
        url = urlparse(victim.engine.base_url)
        assert url.hostname == "127.0.0.4"  # engine1 of llama: job-wide GPU 4, node 2
        generate = victim.engine.generate_seeded

        def node_leaves_mid_rollout(*args, **kwargs):  # the node goes while its share of the step is sent
            nonlocal removed
            if not removed:
                cluster.remove_node(node2, allow_graceful=False)
                removed = True
                wait_refused(url.hostname, url.port)
            return generate(*args, **kwargs)

        victim.engine.generate_seeded = node_leaves_mid_rollout
        with caplog.at_level("WARNING", logger="hacrl_megatron.rollout.engine_pool"):
            later = [loop.train_step(run) for _ in range(2)]
        assert removed
        assert victim.state == "retired"
        warnings = [r.getMessage() for r in caplog.records if r.name == "hacrl_megatron.rollout.engine_pool"]
        assert len(warnings) == 1 and warnings[0].startswith("agent 'llama', engine1: retired from the pool, its node "
                                                             "127.0.0.4"), warnings
        others = [s for rt in run.runtimes for s in rt.engine.slots if s is not victim]
        assert all(s.state == "ready" and s.engine.server.restarts == 0 for s in others)  # no reload elsewhere
        for metrics in later:
            assert metrics["llama/sync_logp_diff"] < 1e-3 * 8 and metrics["qwen3/sync_logp_diff"] < 1e-3 * 8
            assert metrics["llama/rollout/engine1/live"] == 0.0 and metrics["llama/rollout/engine0/live"] == 1.0
    finally:
        for rt in run.runtimes:
            rt.close()
        if removed:  # the node comes back for the resume and the module's other tests
            cluster.add_node(num_cpus=2, num_gpus=2, node_ip_address="127.0.0.4", resources=node_resources(2))
            cluster.wait_for_nodes(timeout=node_wait_s())
    resumed = loop.setup(dataclasses.replace(exp, checkpoint=dataclasses.replace(exp.checkpoint, resume=True)))
    try:
        resumed.verifier.close()
        resumed.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
        assert loop._resume(resumed) and resumed.step == 1
        while resumed.step < exp.train.steps:
            metrics = loop.train_step(resumed)
        assert resumed.step == 3 and metrics["llama/sync_logp_diff"] < 1e-3 * 8
        assert urlparse(resumed.runtimes[0].engine.slots[1].engine.base_url).hostname == "127.0.0.4"  # its node again
    finally:
        for rt in resumed.runtimes:
            rt.close()


@pytest.mark.timeout(2400)  # the Megatron ranks and servers start twice on 2 cores
def test_losing_a_trainer_node_stops_the_run_in_one_line_and_a_resume_finishes(cluster, tmp_path, monkeypatch):
    """The planned job of the test above; node 2 (127.0.0.4, rank 1 of qwen3's TP2 world) leaves the
    cluster right after the step-1 checkpoint: the run stops with one line naming the agent, the node
    and that checkpoint; once the node is back a resume finishes the run."""
    from hacrl_megatron.agents.ray_placement import TrainerNodeLost
    from tests.cluster.conftest import node_wait_s

    exp = planned_job_exp(tmp_path, steps=3)
    exp = dataclasses.replace(exp, checkpoint=dataclasses.replace(exp.checkpoint, every=1))
    (node2,) = [n for n in cluster.list_all_nodes() if n.node_ip_address == "127.0.0.4"]
    save, removed = loop._save, []

    def save_then_lose_node(run):
        save(run)
        if not removed:
            cluster.remove_node(node2, allow_graceful=False)
            removed.append(run.step)

    monkeypatch.setattr(loop, "_save", save_then_lose_node)
    try:
        with pytest.raises(TrainerNodeLost) as err:
            loop.train(exp)
        assert removed == [1]
        message = str(err.value)
        assert "\n" not in message and message.startswith("agent 'qwen3': node 127.0.0.4 (rank 1 of 2) left the Ray "
                                                          "cluster during "), message
        assert message.endswith(f"last checkpoint: {Path(exp.output_dir) / 'checkpoints' / 'step-000001'} "
                                "(continue with checkpoint.resume=true)"), message
    finally:
        if removed:
            cluster.add_node(num_cpus=2, num_gpus=2, node_ip_address="127.0.0.4", resources=node_resources(2))
            cluster.wait_for_nodes(timeout=node_wait_s())
    monkeypatch.setattr(loop, "_save", save)
    run = loop.train(dataclasses.replace(exp, checkpoint=dataclasses.replace(exp.checkpoint, resume=True)))
    assert run.step == 3
    assert [r["ip"] for r in run.runtimes[1].trainer.placement] == ["127.0.0.3", "127.0.0.4"]  # planned again
