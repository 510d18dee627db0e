"""``rollout.weight_sync=distributed`` for a Ray agent: the agent's own ranks push, over gloo.

A TP = 2 qwen2 RayAgent (two Ray actors, gloo) syncs into two stand-in SGLang servers
(tests/fixtures/fake_sglang_server.py, threads of this process, each joining the weight group with
its own replica of SGLang's rendezvous). Through the loop's entry point (``sync_weights`` → engine
pool → a ``DistributedTransport`` built with the agent's ranks, as ``trainer/runtime.py`` builds it
for Ray agents), both ranks gather in their export and rank 0's actor — not this process — joins
the group as group rank 0 and broadcasts the flattened buckets. Checked:

* each server then holds the agent's HF weights bit for bit (the starting checkpoint, then the
  weights after one update, compared with the export that comes back through Ray);
* the group was created by rank 0's process (its pid in the group name), at rank 0's address,
  with world size 1 + 2 servers; buckets respect the size limit, only the last flushes the cache;
* the post-sync probe check of the loop passes on the servers;
* a server that is down fails the push with the engine's error raised in this process, and the
  agent stays usable (its world ran the export to the end).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from hacrl_megatron.agents.ray_agent import RayAgent  # noqa: E402
from hacrl_megatron.rollout import EnginePool, EngineUnreachable, HFEngine, SGLangEngine  # noqa: E402
from hacrl_megatron.sync import check_sync, sync_weights  # noqa: E402
from hacrl_megatron.sync.distributed import DistributedTransport  # noqa: E402
from tests.distributed.megatron_helpers import (  # noqa: E402
    agent_config,
    make_tiny_hf,
    sample_batch,
    sft_loss,
    start_local_ray,
    tiny_hf_config,
    train_config,
)
from tests.fixtures.sglang_standin import StandIn  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]
BUCKET_BYTES = 6000  # tiny: many buckets of a few tensors each


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    start_local_ray()
    yield
    ray.shutdown()


def _receiver() -> HFEngine:
    torch.manual_seed(123)  # other weights than the agent's
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("qwen2"), dtype=torch.float32)
    tokenizer = SimpleNamespace(eos_token_id=0, pad_token_id=0, decode=lambda ids, **kw: " ".join(map(str, ids)))
    return HFEngine(model, tokenizer)


def _assert_servers_hold(servers: list[StandIn], state: dict[str, torch.Tensor]) -> None:
    for server in servers:
        got = server.handler.state.backend.model.state_dict()
        assert set(got) == set(state)
        assert [k for k in state if not torch.equal(got[k], state[k].cpu())] == []


def test_ray_agent_ranks_broadcast_into_the_servers_bit_identically(tmp_path):
    hf = make_tiny_hf("qwen2", os.path.join(tmp_path, "qwen2"), seed=2)
    reference = {k: v.clone() for k, v in hf.state_dict().items()}
    servers = [StandIn(_receiver) for _ in range(2)]
    for s in servers:
        s.start()
    engines = [SGLangEngine(s.base_url, eos_token_id=0, server=s, name=f"engine{k}", timeout=120)
               for k, s in enumerate(servers)]
    agent = RayAgent.from_hf_model(agent_config("qwen2", tp=2, name="r"), hf, train_cfg=train_config(),
                                   use_gpu=False, env_vars={"PYTHONWARNINGS": "ignore"})
    transport = DistributedTransport(BUCKET_BYTES, backend="gloo", group_name="hacrl_r", timeout_s=120, ranks=agent)
    pool = EnginePool(engines, transport, name="r")
    try:
        assert sync_weights(agent, pool) == len(reference)
        _assert_servers_hold(servers, reference)
        assert pool.transport._group is None  # this process never joined the weight group
        rank0_pid = ray.get(agent._workers[0].node_info.remote())["pid"]
        for server in servers:
            (init,) = [r for p, r in server.log if p == "/init_weights_update_group"]
            assert init["group_name"].startswith(f"hacrl_r-{rank0_pid}-") and rank0_pid != os.getpid()
            assert (init["world_size"], init["master_address"], init["backend"]) == (3, "127.0.0.1", "gloo")
            reqs = [r for p, r in server.log if p == "/update_weights_from_distributed"]
            names = [n for r in reqs for n in r["names"]]  # every tensor once (in the export's order)
            assert len(reqs) > 5 and sorted(names) == sorted(reference) and len(names) == len(set(names))
            for r in reqs:
                size = sum(torch.Size(s).numel() * getattr(torch, d).itemsize for s, d in zip(r["shapes"], r["dtypes"]))
                assert size <= BUCKET_BYTES or len(r["names"]) == 1
            assert [r["flush_cache"] for r in reqs] == [False] * (len(reqs) - 1) + [True]
        assert [i["rank_offset"] for s in servers for p, i in s.log if p == "/init_weights_update_group"] == [1, 2]

        batch = sample_batch()
        agent.train([batch], sft_loss)
        assert sync_weights(agent, pool) == len(reference)  # the same group: no second init
        assert all([p for p, _ in s.log].count("/init_weights_update_group") == 1 for s in servers)
        trained = dict(agent.export_hf_weights())  # the other path: through Ray into this process
        assert not torch.equal(trained["model.embed_tokens.weight"], reference["model.embed_tokens.weight"])
        _assert_servers_hold(servers, trained)
        prompt, response = batch.input_ids[0][:3].tolist(), batch.input_ids[0][3:].tolist()
        assert check_sync(agent, pool, prompt, response) < 1e-4

        servers[1].kill()
        with pytest.raises(EngineUnreachable, match="fail.* the health check") as info:
            pool.transport.push(engines, agent.export_hf_weights(), version=9)
        assert any("agent 'r': weight push failed on rank 0" in n for n in info.value.__notes__)
        assert agent.stats()["updates"] == 1.0  # the world is intact
    finally:
        pool.close()
        agent.close()


def test_a_pp2_ray_agent_sends_from_both_stages_and_make_transport_picks_it(tmp_path):
    """The stage-parallel path through real Ray actors (sync/stages.py): ``make_transport`` builds it for
    a Ray agent with PP = 2, each stage's rank sends its own share, the servers hold the export."""
    from hacrl_megatron.config import load_config
    from hacrl_megatron.sync import make_transport
    from hacrl_megatron.sync.stages import StageTransport

    hf = make_tiny_hf("qwen2", os.path.join(tmp_path, "qwen2"), seed=5)
    servers = [StandIn(_receiver) for _ in range(2)]
    for s in servers:
        s.start()
    engines = [SGLangEngine(s.base_url, eos_token_id=0, server=s, name=f"engine{k}", timeout=120)
               for k, s in enumerate(servers)]
    agent = RayAgent.from_hf_model(agent_config("qwen2", pp=2, name="p"), hf, train_cfg=train_config(),
                                   use_gpu=False, env_vars={"PYTHONWARNINGS": "ignore"})
    rollout = load_config("cpu_demo", ["rollout.engine=sglang", "rollout.weight_sync=distributed",
                                       "rollout.weight_sync_bucket_mb=1"]).rollout
    transport = make_transport(rollout, "p", None, None, ranks=agent)
    assert isinstance(transport, StageTransport) and transport.group_name == "hacrl_p"
    pool = EnginePool(engines, transport, name="p")
    try:
        agent.train([sample_batch()], sft_loss)
        assert sync_weights(agent, pool) == len(hf.state_dict())
        exported = dict(agent.export_hf_weights())  # through Ray into this process: the reference
        _assert_servers_hold(servers, exported)
        total = sum(t.numel() * t.element_size() for t in exported.values())
        outcomes = agent.push_outcomes
        assert [o.part for o in outcomes] == ["stage0", "stage1"]
        assert all(0 < o.bytes_sent == o.bytes_held < total for o in outcomes)
        assert sum(o.bytes_sent for o in outcomes) == total
        pids = [ray.get(w.node_info.remote())["pid"] for w in agent._workers]
        for server in servers:
            groups = sorted(r["group_name"] for p, r in server.log if p == "/init_weights_update_group")
            assert [g.split("-")[:3] for g in groups] == [["hacrl_p", "stage0", str(pids[0])],
                                                          ["hacrl_p", "stage1", str(pids[1])]]
    finally:
        pool.close()
        agent.close()
