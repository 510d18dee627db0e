"""EnginePool: several stand-in SGLang servers behind one agent — balanced by pending tokens, a
server that dies mid-step (restarted and resynced while the others' work is kept), per-engine
metrics, and samples that do not depend on how prompts were spread."""

from __future__ import annotations

import pytest
import torch

from hacrl_megatron.agents.hf import HFAgent
from hacrl_megatron.exchange import load_tokenizer
from hacrl_megatron.rollout import EngineError, EnginePool, HFEngine, SamplingParams, SGLangEngine
from hacrl_megatron.sync.disk import DiskTransport
from hacrl_megatron.sync.distributed import DistributedTransport
from tests.fixtures.sglang_standin import StandIn
from tests.unit.test_rollout_hf import QUESTIONS, tiny_llama

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0, max_new_tokens=6)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("char", tmp_path_factory.mktemp("tok"))


def prompts(tok, k=8):
    return [tok(QUESTIONS[i % 4] + " " * i, add_special_tokens=False)["input_ids"] for i in range(k)]


def pool_of(tok, transport, n=3, **kw):
    servers = [StandIn(lambda: HFEngine(tiny_llama(len(tok)), tok), **kw) for _ in range(n)]
    for s in servers:
        s.start()
    engines = [SGLangEngine(s.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=s, name=f"engine{k}",
                            timeout=60) for k, s in enumerate(servers)]
    return EnginePool(engines, transport, name="a"), servers


def entries(server):
    return [len(r["input_ids"]) for p, r in server.log if p == "/generate"]


def test_assignment_is_longest_first_onto_the_least_pending_engine():
    slots = [type("S", (), {"pending_tokens": p})() for p in (0, 50, 0)]
    plan = EnginePool._assign([0, 1, 2, 3, 4], [40, 10, 30, 20, 25], slots)
    # by cost: 40 → e0 (pending 0, lower index wins the tie), 30 → e2 (0), 25 → e2 (30 < 40 < 50),
    # 20 → e0 (40 < 50 < 55), 10 → e1 (50 < 55 < 60)
    assert plan == {0: [0, 3], 1: [1], 2: [2, 4]}


def test_generate_spreads_prompts_and_matches_one_engine(tok, tmp_path):
    pool, servers = pool_of(tok, DiskTransport(tmp_path / "sync"))
    try:
        reference = HFEngine(tiny_llama(len(tok)), tok).generate(prompts(tok), GREEDY)
        assert pool.generate(prompts(tok), GREEDY) == reference
        shares = [sum(entries(s)) for s in servers]
        assert sum(shares) == 8 and min(shares) >= 2  # every engine got work
        params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=9)
        one, one_servers = pool_of(tok, DiskTransport(tmp_path / "one"), n=1, deterministic=True)
        many, many_servers = pool_of(tok, DiskTransport(tmp_path / "many"), n=3, deterministic=True)
        try:  # the seed of sample j of prompt i is fixed before the split: same samples on 1 or 3 engines
            assert one.generate(prompts(tok), params) == many.generate(prompts(tok), params)
        finally:
            one.close()
            many.close()
    finally:
        pool.close()


def test_engine_dying_mid_step_is_restarted_and_resynced_from_disk(tok, tmp_path):
    pool, servers = pool_of(tok, DiskTransport(tmp_path / "sync"))
    try:
        other = tiny_llama(len(tok), seed=1)
        pool.load_weights(other.state_dict().items())
        servers[1].die_after_generates = 0  # its next /generate kills it, mid-request
        expected = HFEngine(other, tok).generate(prompts(tok), GREEDY)
        assert pool.generate(prompts(tok), GREEDY) == expected
        pool._join_recoveries()
        assert servers[1].restarts == 1 and pool.slots[1].state == "ready"
        # resynced to version 1 after the restart, before it served anything (it may serve again later in
        # the same step once it is ready: the pool hands it work as soon as its resync is done)
        log1 = [(path, req) for path, req in servers[1].log if path != "/health"]
        died_at = [path for path, _ in log1].index("/generate")  # its first /generate killed it
        after_restart = log1[died_at + 1:]
        assert after_restart and after_restart[0][0] == "/update_weights_from_disk", after_restart
        served_after_restart = sum(len(r["input_ids"]) for p, r in after_restart if p == "/generate")
        lost = pool.slots[1].lost_jobs
        redone_and_rest = sum(sum(entries(s)) for s in (servers[0], servers[2])) + served_after_restart
        assert lost >= 2 and redone_and_rest == 8  # only its share redone, by the others or by itself once resynced
        assert pool.engines[1].generate(prompts(tok), GREEDY) == expected
        stats = pool.stats()
        assert stats["engine1/restarts"] == 1 and stats["engine1/lost_jobs"] == lost and stats["restarts"] == 1
        assert stats["engine0/tokens_per_s"] > 0 and stats["sequences"] >= 8 and stats["weight_version"] == 1
    finally:
        pool.close()


def test_restarted_engine_is_resynced_from_the_trainer_with_distributed_sync(tok, tmp_path):
    transport = DistributedTransport(30_000, backend="gloo", group_name="pool", timeout_s=60)
    pool, servers = pool_of(tok, transport, n=2)
    try:
        agent = HFAgent("a", tiny_llama(len(tok), seed=2), lr=1e-3)
        pool.sync_from(agent.export_hf_weights)
        servers[0].die_after_generates = 0
        expected = HFEngine(agent.model, tok).generate(prompts(tok), GREEDY)
        assert pool.generate(prompts(tok), GREEDY) == expected
        pool._join_recoveries()
        assert pool.slots[0].state == "stale"  # restarted on its initial weights; the agent is not touched here
        assert pool.generate(prompts(tok), GREEDY) == expected  # the next call pushes the agent's export first
        assert pool.slots[0].state == "ready"
        assert pool.engines[0].generate(prompts(tok), GREEDY) == expected
        pool.sync_from(agent.export_hf_weights)  # the next sync rebuilds one group for both engines
        inits = [r for p, r in servers[1].log if p == "/init_weights_update_group"]
        assert len(inits) == 2 and inits[-1]["world_size"] == 3
    finally:
        pool.close()


def test_engine_dying_before_a_sync_is_dropped_from_it_and_restarted(tok, tmp_path):
    pool, servers = pool_of(tok, DiskTransport(tmp_path / "sync"))
    try:
        agent = HFAgent("a", tiny_llama(len(tok), seed=5), lr=1e-3)
        servers[2].kill()  # between two steps: the sync is the first to notice
        assert pool.sync_from(agent.export_hf_weights) == len(agent.model.state_dict())
        pool._join_recoveries()
        assert servers[2].restarts == 1 and pool.slots[2].state == "ready" and pool.weight_version == 1
        expected = HFEngine(agent.model, tok).generate(prompts(tok), GREEDY)
        assert all(e.generate(prompts(tok), GREEDY) == expected for e in pool.engines)
    finally:
        pool.close()


def test_no_engine_left(tok, tmp_path):
    pool, servers = pool_of(tok, DiskTransport(tmp_path / "sync"), n=1)
    pool.slots[0].engine.server = None  # nothing this process could restart
    servers[0].kill()
    with pytest.raises(EngineError, match="no engine can generate .*engine0: dead"):
        pool.generate(prompts(tok), GREEDY)
    with pytest.raises(EngineError, match="every engine is down"):
        pool.load_weights(tiny_llama(len(tok)).state_dict().items())
