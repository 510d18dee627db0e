"""Losing a node: an engine whose node left the cluster is retired from its pool with one warning
(no restart elsewhere, no reload at every later sync) while the survivors go on; a trainer rank
whose node left stops the agent with an error naming the agent and the node."""

from __future__ import annotations

import time

import pytest

from hacrl_megatron.rollout import EnginePool, HFEngine, SGLangEngine
from hacrl_megatron.rollout.protocol import EngineNodeLost
from hacrl_megatron.sync.disk import DiskTransport
from tests.fixtures.sglang_standin import StandIn
from tests.unit.test_engine_pool import GREEDY, prompts, tok  # noqa: F401  (the module's tokenizer fixture)
from tests.unit.test_rollout_hf import tiny_llama

ray = pytest.importorskip("ray")


def _warnings_when_retired(pool, caplog, wait_s: float = 60.0) -> list[str]:
    """The package's warnings once slot 1 is retired and its warning is logged (a bounded wait for the event:
    the recovery thread sets the state and logs, and a loaded machine may run it seconds later)."""
    deadline = time.monotonic() + wait_s
    while True:
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("hacrl")]
        if (pool.slots[1].state == "retired" and warnings) or time.monotonic() > deadline:
            return warnings
        time.sleep(0.05)


def test_engine_on_a_lost_node_is_retired_once_and_never_reloaded(tok, tmp_path, caplog):  # noqa: F811
    servers = [StandIn(lambda: HFEngine(tiny_llama(len(tok)), tok)) for _ in range(3)]
    for s in servers:
        s.start()
    engines = [SGLangEngine(s.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=s, name=f"engine{k}",
                            timeout=60) for k, s in enumerate(servers)]
    pool = EnginePool(engines, DiskTransport(tmp_path / "sync"), name="llama")
    attempts = []

    def lost_restart():
        attempts.append(1)
        raise EngineNodeLost("its node 127.0.0.4 (Ray node abc) left the cluster")

    servers[1].restart = lost_restart
    try:
        other = tiny_llama(len(tok), seed=1)
        pool.load_weights(other.state_dict().items())
        servers[1].die_after_generates = 0  # its node goes away with a request in flight
        expected = HFEngine(other, tok).generate(prompts(tok), GREEDY)
        with caplog.at_level("WARNING", logger="hacrl_megatron.rollout.engine_pool"):
            assert pool.generate(prompts(tok), GREEDY) == expected  # its prompts redone on the survivors
            pool._join_recoveries()
            third = tiny_llama(len(tok), seed=2)
            for _ in range(3):  # later syncs and steps: no restart attempt, no reload, no error
                pool.load_weights(third.state_dict().items())
                assert pool.generate(prompts(tok), GREEDY) == HFEngine(third, tok).generate(prompts(tok), GREEDY)
            warnings = _warnings_when_retired(pool, caplog)  # the retirement is logged by its recovery thread
        assert attempts == [1] and pool.slots[1].state == "retired"
        assert warnings == ["agent 'llama', engine1: retired from the pool, its node 127.0.0.4 (Ray node abc) left "
                            "the cluster; 2 engine(s) go on"]
        loads = [p for p, _ in servers[1].log if p == "/update_weights_from_disk"]
        assert len(loads) == 1  # only the sync before it was lost
        assert pool.stats()["engine1/live"] == 0
    finally:
        pool.close()


def test_remote_server_restart_on_a_lost_node_raises_at_once(monkeypatch):
    from hacrl_megatron.rollout.engine_actor import RemoteServer

    respawned = []
    server = RemoteServer("actor", "http://127.0.0.4:9000", 1, respawn=lambda: respawned.append(1), node_id="n" * 40)
    monkeypatch.setattr(server, "actor_alive", lambda: False)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "n" * 40, "Alive": False}, {"NodeID": "m", "Alive": True}])
    with pytest.raises(EngineNodeLost, match=r"its node 127.0.0.4 \(Ray node nnnnnnnnnnnn\) left the cluster"):
        server.restart()
    assert respawned == []  # no replacement on another node
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "n" * 40, "Alive": True}])
    assert not server.node_gone()


def test_trainer_rank_on_a_lost_node_names_agent_and_node(monkeypatch):
    from hacrl_megatron.agents import ray_agent
    from hacrl_megatron.agents.ray_placement import TrainerNodeLost

    class FakeRay:
        def wait(self, pending, num_returns=1, timeout=None):
            return pending[:1], pending[1:]

        def get(self, ref):
            if ref == "r1":
                raise ray.exceptions.ActorDiedError()
            return "ok"

        def nodes(self):
            return [{"NodeManagerAddress": "127.0.0.3", "Alive": True},
                    {"NodeManagerAddress": "127.0.0.4", "Alive": False}]

        def kill(self, actor, no_restart=True):
            pass

    monkeypatch.setattr(ray_agent, "require_ray", lambda: FakeRay())
    monkeypatch.setattr(ray_agent, "release", lambda pg: None)
    agent = object.__new__(ray_agent.RayAgent)
    agent.name, agent._dead, agent._workers, agent._pg = "qwen3", None, ["w0", "w1"], "pg"
    agent.call_timeout_s = None
    agent.placement = [{"ip": "127.0.0.3"}, {"ip": "127.0.0.4"}]
    with pytest.raises(TrainerNodeLost, match=r"agent 'qwen3': node 127.0.0.4 \(rank 1 of 2\) left the Ray cluster "
                                              r"during train"):
        agent._gather(["r0", "r1"], "train")


def test_a_peer_connection_error_is_reported_as_the_node_that_left(monkeypatch):
    """A surviving rank's gloo error ("Connection closed by peer") comes before the dead rank's own:
    the agent names the node that left (once the cluster says so), not the socket."""
    from hacrl_megatron.agents import ray_agent

    alive = {"127.0.0.3": True, "127.0.0.4": True}
    polls = []

    class FakeRay:
        def nodes(self):
            polls.append(1)
            if len(polls) >= 3:  # the cluster notices the dead node a few seconds later
                alive["127.0.0.4"] = False
            return [{"NodeManagerAddress": ip, "Alive": up} for ip, up in alive.items()]

    monkeypatch.setattr(ray_agent.time, "sleep", lambda s: None)
    agent = object.__new__(ray_agent.RayAgent)
    agent.placement = [{"ip": "127.0.0.3"}, {"ip": "127.0.0.4"}]
    gloo = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:38536"
    assert agent._lost_peer_node(FakeRay(), gloo) == ("127.0.0.4", 1)
    polls.clear()
    assert agent._lost_peer_node(FakeRay(), "ValueError: a bad batch") is None and polls == []  # its own error
    alive["127.0.0.4"] = True
    monkeypatch.setattr(ray_agent, "PEER_LOSS_WAIT_S", 0.0)
    polls.clear()

    class Healthy(FakeRay):
        def nodes(self):
            return [{"NodeManagerAddress": ip, "Alive": True} for ip in alive]

    assert agent._lost_peer_node(Healthy(), gloo) is None  # every node alive: the error stays the rank's
