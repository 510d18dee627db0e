"""Distributed weight sync run by an agent's own ranks (sync/distributed.py, agents/ray_worker.py),
in one process: two :class:`RankWorker` objects stand for a Ray agent's ranks, their exports are
stubs (no collectives), and every argument crosses a pickle round trip as Ray would ship it.

What is checked: a transport built with the agent's ranks has them push, never reads the export it
is handed nor joins a group itself; rank 0's sender joins the group and broadcasts into two stand-in
servers, which then hold the pushed state dict bit for bit; the senders persist between pushes and
are rebuilt after a server restart; a server dying fails the push with the world in step (rank 0
ran its whole export), and the engine pool then syncs the survivor and restores the restarted one.
The same path with real Ray actors and a TP = 2 Megatron agent: tests/distributed/test_ray_weight_push.py.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from hacrl_megatron.agents.ray_worker import PushOutcome, RankWorker
from hacrl_megatron.exchange import load_tokenizer
from hacrl_megatron.rollout import EnginePool, EngineUnreachable, HFEngine, SamplingParams, SGLangEngine
from hacrl_megatron.sync.distributed import DistributedTransport, RankSource, push_from_rank
from tests.fixtures.sglang_standin import StandIn
from tests.unit.test_rollout_hf import QUESTIONS, tiny_llama

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)
BUCKET_BYTES = 40_000


def _ship(obj):
    return pickle.loads(pickle.dumps(obj))


class StubLocal:
    """A LocalAgent's export: the same HF state dict on every rank, counted."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state
        self.exports = 0

    def export_hf_weights(self):
        self.exports += 1
        yield from self.state.items()


class InProcessRanks:
    """A :class:`RankSource` whose ranks are RankWorker objects of this process (RayAgent's calls)."""

    def __init__(self, state: dict[str, torch.Tensor], world: int = 2) -> None:
        self.workers = []
        for rank in range(world):
            worker = RankWorker("a")
            worker.rank, worker._local = rank, StubLocal(state)
            self.workers.append(worker)
        self.opened = 0
        self.outcomes: list[PushOutcome] = []

    def open_weight_sender(self, make_sender) -> None:
        self.opened += 1
        for w in self.workers:
            w.open_weight_sender(_ship(make_sender))

    def push_weights(self, engines, version: int) -> int:
        # the engines travel as detached clients: no server process handle, no tokenizer
        assert all(e.server is None and e.tokenizer is None for e in engines), engines
        self.outcomes = [w.push_weights(_ship(list(engines)), version) for w in reversed(self.workers)][::-1]
        for outcome in self.outcomes:
            if outcome.error is not None:
                raise outcome.error
        return self.outcomes[0].count

    def close_weight_sender(self) -> None:
        for w in self.workers:
            w.close_weight_sender()


class UnreadExport:
    """A Ray export stream (``RayAgent.export_hf_weights``): a transport whose ranks push must never read it."""

    def __init__(self, ranks: InProcessRanks) -> None:
        self.ranks = ranks

    def __iter__(self):
        raise AssertionError("the controller read the export: the tensors would pass through it")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("char", tmp_path_factory.mktemp("tok"))


def make_pool(tok, ranks, n_engines=2):
    servers = [StandIn(lambda: HFEngine(tiny_llama(len(tok)), tok)) for _ in range(n_engines)]
    for s in servers:
        s.start()
    engines = [SGLangEngine(s.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=s, name=f"engine{k}",
                            timeout=60) for k, s in enumerate(servers)]
    transport = DistributedTransport(BUCKET_BYTES, backend="gloo", group_name="ranks", timeout_s=60, ranks=ranks)
    return EnginePool(engines, transport, name="a"), servers


def assert_holds(server: StandIn, state: dict[str, torch.Tensor]) -> None:
    got = server.handler.state.backend.model.state_dict()
    assert set(got) == set(state)
    assert [k for k in state if not torch.equal(got[k], state[k])] == []


def test_a_ray_export_is_pushed_by_rank_0_and_the_group_persists_until_a_restart(tok):
    pushed = dict(tiny_llama(len(tok), seed=1).state_dict())
    ranks = InProcessRanks(pushed)
    assert isinstance(ranks, RankSource)
    pool, servers = make_pool(tok, ranks)
    try:
        assert pool.sync_from(lambda: UnreadExport(ranks)) == len(pushed)
        assert pool.transport._group is None  # the controller joined no group
        rank0 = ranks.workers[0]._sender.transport
        assert rank0 is not None and ranks.workers[1]._sender.transport is None and rank0.buckets_sent > 2
        assert [w._local.exports for w in ranks.workers] == [1, 1]
        for s in servers:
            assert_holds(s, pushed)
            reqs = [r for p, r in s.log if p == "/update_weights_from_distributed"]
            assert len(reqs) == rank0.buckets_sent and [n for r in reqs for n in r["names"]] == list(pushed)
        inits = [[r for p, r in s.log if p == "/init_weights_update_group"] for s in servers]
        assert [(i[0]["rank_offset"], i[0]["world_size"], i[0]["master_address"]) for i in inits] == [
            (1, 3, "127.0.0.1"), (2, 3, "127.0.0.1")]

        assert pool.sync_from(lambda: UnreadExport(ranks)) == len(pushed)  # same senders, same group
        assert ranks.opened == 1 and [len([p for p, _ in s.log if p == "/init_weights_update_group"])
                                      for s in servers] == [1, 1]

        servers[1].restart()  # back on its initial weights, out of the group
        assert not pool.transport.restore(pool.slots[1].engine, pool.weight_version)
        assert pool.sync_from(lambda: UnreadExport(ranks)) == len(pushed)
        assert ranks.opened == 2 and rank0._group is None  # the old sender closed its group
        assert [p for p, _ in servers[0].log].count("/destroy_weights_update_group") == 1
        assert_holds(servers[1], pushed)
        with pytest.raises(ValueError, match="the agent's ranks send their own export"):
            pool.load_weights(pushed.items())  # tensors of this process: refused, not replaced by the ranks'
    finally:
        pool.close()
    assert all(w._sender is None for w in ranks.workers)  # closing the pool closed the ranks' senders


def test_a_server_dying_fails_the_ranks_push_in_step_and_the_pool_recovers(tok):
    pushed = dict(tiny_llama(len(tok), seed=2).state_dict())
    ranks = InProcessRanks(pushed)
    pool, servers = make_pool(tok, ranks)
    try:
        servers[1].kill()
        assert pool.sync_from(lambda: UnreadExport(ranks)) == len(pushed)  # retried with the survivor
        assert_holds(servers[0], pushed)
        # the failed attempt: rank 0 returned the server's error after running its whole export
        assert [w._local.exports for w in ranks.workers] == [2, 2]
        pool._join_recoveries()  # restarted in the background; it waits for the trainer's weights
        expected = HFEngine(tiny_llama(len(tok), seed=2), tok).generate(
            [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS], GREEDY)
        prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]
        assert pool.generate(prompts, GREEDY) == expected  # resynced through the ranks first
        assert_holds(servers[1], pushed) and servers[1].restarts == 1
    finally:
        pool.close()


def test_a_failed_push_on_rank_0_runs_the_rest_of_its_export():
    produced = []

    def export():
        for k in range(5):
            produced.append(k)
            yield f"w{k}", torch.full((4,), float(k))

    dead = SGLangEngine("http://127.0.0.1:9", eos_token_id=0, timeout=5)
    transport = DistributedTransport(16, backend="gloo", group_name="dead", timeout_s=5)
    with pytest.raises(EngineUnreachable):
        push_from_rank(export(), transport, [dead], version=1)
    assert produced == [0, 1, 2, 3, 4]  # the other ranks' gathers would otherwise wait forever
