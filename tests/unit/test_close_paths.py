"""Close paths survive every Ray error and setup closes what it built.

- ``RemoteServer.stop``: a call that fails with any RayError (an out-of-memory kill, a lost node, a
  timeout), and a ``ray.kill`` or group removal that fails, still release the engine's placement
  group share; nothing raises.
- ``RayAgent`` teardown: a rank actor that cannot be killed does not keep the others alive or the
  placement group reserved.
- ``loop.setup``: when a later agent (or a later part of setup) fails, the runtimes already built are
  closed and the original error is the one raised.
"""

from __future__ import annotations

import pytest

from hacrl_megatron.trainer import loop
from tests.e2e.test_trainer import tiny_exp

ray = pytest.importorskip("ray")


class FakeGroup:
    def __init__(self) -> None:
        self.released = 0

    def release_one(self) -> None:
        self.released += 1


@pytest.mark.parametrize("error", [ray.exceptions.OutOfMemoryError("oom"), ray.exceptions.NodeDiedError("gone"),
                                   ray.exceptions.GetTimeoutError("late"), ray.exceptions.RaySystemError("gcs")])
def test_remote_server_stop_survives_any_ray_error(monkeypatch, error):
    from hacrl_megatron.rollout.engine_actor import RemoteServer

    killed = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    server = RemoteServer(actor="actor-0", base_url="http://127.0.0.3:1", tp_size=1, group=FakeGroup())
    group = server._group
    monkeypatch.setattr(server, "_call", lambda *a, **k: (_ for _ in ()).throw(error))
    server.stop()
    assert killed == ["actor-0"] and group.released == 1 and server._group is None
    server.stop()  # idempotent: the share is given back once
    assert group.released == 1


def test_remote_server_stop_releases_the_group_when_kill_fails(monkeypatch, caplog):
    from hacrl_megatron.rollout import engine_actor
    from hacrl_megatron.rollout.engine_actor import RemoteServer, _Group

    removed = []

    def kill(actor, no_restart=True):
        raise ConnectionError("the GCS is gone")

    def remove(group):
        removed.append(group)
        raise RuntimeError("cannot reach the GCS either")

    monkeypatch.setattr(ray, "kill", kill)
    monkeypatch.setattr(ray.util, "remove_placement_group", remove)
    shared = _Group("pg-1", 2)
    a = RemoteServer("a0", "http://127.0.0.3:1", 1, shared)
    b = RemoteServer("a1", "http://127.0.0.4:1", 1, shared)
    for server in (a, b):
        server._call = lambda *args, **kw: (_ for _ in ()).throw(ray.exceptions.RayActorError())
    with caplog.at_level("WARNING", logger=engine_actor.__name__):
        a.stop()
        assert removed == []  # one member left
        b.stop()
    assert removed == ["pg-1"] and shared.remaining == 0
    assert "could not kill Ray actor" in caplog.text and "could not remove placement group" in caplog.text


def test_ray_agent_teardown_kills_every_rank_and_releases_despite_errors(monkeypatch):
    from hacrl_megatron.agents import ray_agent, ray_placement

    killed, released = [], []

    def kill(actor, no_restart=True):
        killed.append(actor)
        if actor == "rank0":
            raise ray.exceptions.RaySystemError("node lost")

    monkeypatch.setattr(ray, "kill", kill)
    monkeypatch.setattr(ray_agent, "release", lambda pg: released.append(pg))
    agent = object.__new__(ray_agent.RayAgent)
    agent.name, agent._dead, agent._workers, agent._pg = "llama", None, ["rank0", "rank1"], "pg"
    agent.close()
    assert killed == ["rank0", "rank1"] and released == ["pg"] and agent._pg is None
    agent.close()  # idempotent
    assert released == ["pg"]
    # release itself logs a failing removal instead of raising (close paths go on)
    import sys

    module = sys.modules["ray.util.placement_group"]
    monkeypatch.setattr(module, "remove_placement_group", lambda pg: (_ for _ in ()).throw(RuntimeError("gone")))
    ray_placement.release("pg")


class FakeRuntime:
    tokenizer = engine = None

    def __init__(self, name: str, closed: list[str]) -> None:
        self.name, self._closed = name, closed

    def close(self) -> None:
        self._closed.append(self.name)


def test_setup_closes_built_agents_when_a_later_agent_fails(tmp_path, monkeypatch):
    closed: list[str] = []

    def build(exp, i, total_updates):
        if i == 1:
            raise RuntimeError("agent 'qwen3': no room for its trainer")
        return FakeRuntime(exp.agents[i].name, closed)

    monkeypatch.setattr(loop, "build_runtime", build)
    with pytest.raises(RuntimeError, match="agent 'qwen3': no room"):
        loop.setup(tiny_exp(tmp_path))
    assert closed == ["llama"]


def test_setup_closes_every_agent_when_a_later_part_fails(tmp_path, monkeypatch):
    closed: list[str] = []
    monkeypatch.setattr(loop, "build_runtime", lambda exp, i, n: FakeRuntime(exp.agents[i].name, closed))

    def broken_source(*args, **kwargs):
        raise OSError("rollout source failed")

    class Verifier:
        def __init__(self, **kwargs) -> None:
            pass

        def close(self) -> None:
            closed.append("verifier")

    monkeypatch.setattr(loop, "make_source", broken_source)
    monkeypatch.setattr(loop, "Exchange", lambda *a, **k: None)  # fake runtimes have no tokenizers
    monkeypatch.setattr(loop, "VerifierPool", Verifier)
    with pytest.raises(OSError, match="rollout source failed"):
        loop.setup(tiny_exp(tmp_path))
    assert closed == ["verifier", "qwen3", "llama"]
