"""Weight sync from every pipeline stage at once (sync/stages.py), in one process.

Four :class:`RankWorker` objects stand for a TP = 2 · PP = 2 Ray agent's ranks, each in its own
thread (as Ray runs them: concurrently), their exports stubs that yield their own stage's share of an
HF state dict; every argument crosses a pickle round trip as Ray would ship it. Two stand-in SGLang
servers (tests/fixtures/fake_sglang_server.py: one request at a time on the model, as SGLang's
scheduler) receive. Checked:

* each stage's first TP rank joins a group of its own with every engine rank and broadcasts only its
  stage's tensors; the servers then hold the whole state dict bit for bit; the bytes each rank sent
  and held are its stage's share, never the whole model;
* the stages take turns on the engines: the buckets of the two stages never overlap on a server,
  even with two servers that would otherwise wait for each other in two groups;
* the controller opens one session per engine around both stages; every stage's last bucket flushes;
* a refused bucket on one stage fails the push naming that stage and its rank, with the world in step,
  and the next push rebuilds the groups;
* the roles: one sender per stage (TP rank 0 of DP replica 0), the other replicas take no part.
"""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
import torch.distributed as dist

from hacrl_megatron.agents.ray_worker import PushOutcome, RankWorker, push_total
from hacrl_megatron.exchange import load_tokenizer
from hacrl_megatron.rollout import EngineError, EnginePool, HFEngine, SGLangEngine
from hacrl_megatron.sync.stages import StageRole, StageTransport, StageTurns, stage_roles
from tests.fixtures.sglang_standin import StandIn
from tests.unit.test_rollout_hf import tiny_llama

torch.set_num_threads(1)
BUCKET_BYTES = 20_000  # several buckets per stage
_STORE = dist.HashStore()  # the turns' store for the in-process ranks (the agent world's store on a real agent)


def shared_store():
    return _STORE


def stage_of(name: str, layers: int = 2, stages: int = 2) -> int:
    """Which pipeline stage owns an HF tensor (the embedding on the first, norm and head on the last)."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) * stages // layers
    return 0 if name.startswith("model.embed_tokens") else stages - 1


class StageLocal:
    """A LocalAgent of pipeline stage ``stage``: its stage export yields that stage's share."""

    def __init__(self, state: dict[str, torch.Tensor], stage: int) -> None:
        self.state, self.stage, self.exports = state, stage, 0

    def export_stage_hf_weights(self):
        self.exports += 1
        yield from ((n, t) for n, t in self.state.items() if stage_of(n) == self.stage)

    def export_hf_weights(self):
        raise AssertionError("a stage-parallel push never exports the whole model on a rank")


def layout(tp: int, pp: int, dp: int = 1, ep: int = 1) -> list[dict]:
    """``ParallelInfo`` dicts in megatron's rank order (TP fastest, then DP, then PP)."""
    return [{"tp": tp, "pp": pp, "dp": dp, "ep": ep, "tp_rank": r % tp, "dp_rank": r // tp % dp,
             "pp_rank": r // (tp * dp), "rank": r} for r in range(tp * pp * dp)]


class StageRanks:
    """A TP2·PP2 RankSource whose ranks are RankWorker objects of this process, run in threads."""

    pipeline_stages = 2

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.infos = layout(2, 2)
        self.workers = []
        for info in self.infos:
            worker = RankWorker("a")
            worker.rank, worker._local = info["rank"], StageLocal(state, info["pp_rank"])
            self.workers.append(worker)
        self.opened = 0
        self.outcomes: list[PushOutcome] = []

    def open_weight_sender(self, make_sender) -> None:
        self.opened += 1
        for w in self.workers:
            w.open_weight_sender(pickle.loads(pickle.dumps(make_sender)))

    def push_weights(self, engines, version: int) -> int:
        outcomes: list = [None] * len(self.workers)

        def run(k: int) -> None:
            outcomes[k] = self.workers[k].push_weights(pickle.loads(pickle.dumps(list(engines))), version)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(self.workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.outcomes = outcomes
        for o in outcomes:
            if o.error is not None:
                raise o.error
        return push_total(outcomes)

    def close_weight_sender(self) -> None:
        for w in self.workers:
            w.close_weight_sender()


class UnreadExport:
    def __init__(self, ranks) -> None:
        self.ranks = ranks

    def __iter__(self):
        raise AssertionError("the controller read the export: the tensors would pass through it")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("char", tmp_path_factory.mktemp("tok"))


def make_pool(tok, ranks):
    servers = [StandIn(lambda: HFEngine(tiny_llama(len(tok), tie=False), tok)) for _ in range(2)]
    for s in servers:
        s.start()
    engines = [SGLangEngine(s.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=s, name=f"engine{k}",
                            timeout=60) for k, s in enumerate(servers)]
    transport = StageTransport(BUCKET_BYTES, backend="gloo", group_name="st", timeout_s=60, ranks=ranks,
                               store=shared_store)
    return EnginePool(engines, transport, name="a"), servers


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_every_stage_sends_its_own_share_in_turns_and_the_servers_hold_the_whole_state_dict(tok):
    pushed = dict(tiny_llama(len(tok), seed=3, tie=False).state_dict())
    share = [nbytes(t for n, t in pushed.items() if stage_of(n) == k) for k in range(2)]
    ranks = StageRanks(pushed)
    pool, servers = make_pool(tok, ranks)
    try:
        assert pool.sync_from(lambda: UnreadExport(ranks)) == len(pushed)
        senders = [w._sender for w in ranks.workers]
        assert [s.transport is not None for s in senders] == [True, False, True, False]  # TP rank 0 of each stage
        # bytes: each sender broadcast its stage's share, each rank held its stage's share, no rank the model
        assert [(o.part, o.bytes_sent, o.bytes_held) for o in ranks.outcomes] == [
            ("stage0", share[0], share[0]), ("stage0", 0, share[0]), ("stage1", share[1], share[1]),
            ("stage1", 0, share[1])]
        assert sum(share) == nbytes(pushed.values()) and max(share) < nbytes(pushed.values())
        for server in servers:
            got = server.handler.state.backend.model.state_dict()
            assert set(got) == set(pushed) and [k for k in pushed if not torch.equal(got[k], pushed[k])] == []
            inits = [r for p, r in server.log if p == "/init_weights_update_group"]
            assert sorted(i["group_name"].split("-")[1] for i in inits) == ["stage0", "stage1"]
            assert {i["world_size"] for i in inits} == {3}
            reqs = [r for p, r in server.log if p == "/update_weights_from_distributed"]
            by_stage = {k: [r for r in reqs if f"-stage{k}-" in r["group_name"]] for k in range(2)}
            for k, stage_reqs in by_stage.items():
                assert len(stage_reqs) > 1 and {stage_of(n) for r in stage_reqs for n in r["names"]} == {k}
                assert [r["flush_cache"] for r in stage_reqs] == [False] * (len(stage_reqs) - 1) + [True]
            assert sorted(n for r in reqs for n in r["names"]) == sorted(pushed)
            paths = [p for p, _ in server.log if "weight" in p]
            assert paths[0] == "/begin_weight_update" and paths[-1] == "/end_weight_update"
            assert paths.count("/begin_weight_update") == 1
        # turns: no two stages' buckets on the wire at once, on any server (with NCCL they would wait for each other)
        receives = sorted((start, end, group) for s in servers for group, start, end in s.handler.state.receives)
        overlaps = [(a, b) for i, a in enumerate(receives) for b in receives[i + 1:] if a[2] != b[2] and b[0] < a[1]]
        assert overlaps == []
        orders = [[g for g, _, _ in s.handler.state.receives] for s in servers]
        assert orders[0] == orders[1]

        assert pool.sync_from(lambda: UnreadExport(ranks)) == len(pushed)  # the same senders and groups
        assert ranks.opened == 1
        assert all([p for p, _ in s.log].count("/init_weights_update_group") == 2 for s in servers)
    finally:
        pool.close()
    assert all(w._sender is None for w in ranks.workers)


def test_a_refused_bucket_on_one_stage_names_the_stage_and_rank_and_the_next_push_rebuilds(tok):
    pushed = dict(tiny_llama(len(tok), seed=4, tie=False).state_dict())
    ranks = StageRanks(pushed)
    pool, servers = make_pool(tok, ranks)
    try:
        servers[1].refuse_buckets_of("model.layers.1.")  # pipeline stage 1's layer
        with pytest.raises(EngineError, match=r"pipeline stage 1 of 2 \(trainer rank 2\): weight group 'st-stage1'"):
            pool.transport.push(pool.engines, UnreadExport(ranks), version=1)
        assert [w._local.exports for w in ranks.workers] == [1, 1, 1, 1]  # every rank ran its export to the end
        assert [o.error is not None for o in ranks.outcomes] == [False, False, True, False]
        servers[1].refuse_buckets_of(None)
        assert all(not s.handler.state.session_open for s in servers)  # the controller closed the sessions
        assert pool.transport.push(pool.engines, UnreadExport(ranks), version=2) == len(pushed)
        assert ranks.opened == 2  # new senders, new groups
        for server in servers:
            got = server.handler.state.backend.model.state_dict()
            assert [k for k in pushed if not torch.equal(got[k], pushed[k])] == []
    finally:
        pool.close()


def test_one_sender_per_stage_and_replicas_beyond_the_first_take_no_part():
    roles = stage_roles(layout(tp=2, pp=2, dp=2))
    assert [r.rank for r in roles if r.sends] == [0, 4]
    assert [r.rank for r in roles if r.exports] == [0, 1, 4, 5]
    assert [(r.part, str(r)) for r in roles][4] == ("stage1", "pipeline stage 1 of 2 (trainer rank 4)")
    moe = stage_roles(layout(tp=1, pp=2, dp=2, ep=2))  # the experts are broadcast over EP across the replicas
    assert [r.rank for r in moe if r.exports] == [0, 1, 2, 3] and [r.rank for r in moe if r.sends] == [0, 2]
    with pytest.raises(ValueError, match="one sender per pipeline stage"):
        stage_roles([{"tp": 1, "pp": 2, "dp": 1, "tp_rank": 0, "dp_rank": 0, "pp_rank": 0}] * 2)
    assert isinstance(roles[0], StageRole)


def test_turns_go_first_come_first_served_and_across_pushes():
    store = dist.HashStore()
    a, b = StageTurns(store, "t", 5), StageTurns(store, "t", 5)
    a.acquire()
    order = []
    waiter = threading.Thread(target=lambda: (b.acquire(), order.append("b"), b.release()))
    waiter.start()
    order.append("a")
    a.release()
    waiter.join(timeout=5)
    assert order == ["a", "b"]
    a.acquire()  # the next push: tickets keep counting
    a.acquire()  # held: no second ticket
    a.release()
    late = StageTurns(store, "t", 0.2)
    a.acquire()
    with pytest.raises(TimeoutError, match="turn 5 did not come"):
        late.acquire()


class LayoutOnly:
    """A Ray agent as make_transport sees it: its PP and its ranks' layouts."""

    def __init__(self, tp: int, pp: int) -> None:
        self.pipeline_stages, self.infos = pp, layout(tp, pp)


@pytest.mark.parametrize("engine, pp, expected", [
    ("sglang", 2, "StageTransport"), ("sglang", 1, "DistributedTransport"),
    ("vllm", 2, "VLLMStageTransport"), ("vllm", 1, "VLLMNCCLTransport"),
])
def test_make_transport_sends_from_every_stage_of_a_ray_agent_with_pp_above_1(engine, pp, expected):
    from hacrl_megatron.config import load_config
    from hacrl_megatron.sync import make_transport

    r = load_config("cpu_demo", [f"rollout.engine={engine}", "rollout.weight_sync=distributed"]).rollout
    transport = make_transport(r, "a", None, None, ranks=LayoutOnly(2, pp))
    assert type(transport).__name__ == expected
    if pp > 1:
        assert [role.rank for role in transport.roles if role.sends] == [0, 2]


def test_vllm_auto_sends_from_the_trainers_ranks_for_a_ray_agent_on_gpus_and_keeps_disk_otherwise():
    from hacrl_megatron.config import AgentConfig, ParallelConfig, load_config
    from hacrl_megatron.sync import resolve_weight_sync

    v = load_config("cpu_demo", ["rollout.engine=vllm"]).rollout
    assert v.vllm.auto_weight_sync(False, ray_agent=True, cuda=True) == "distributed"
    assert {v.vllm.auto_weight_sync(c, ray_agent=a, cuda=g) for c, a, g in
            [(False, False, True), (False, True, False), (True, True, True)]} == {"disk"}
    assert resolve_weight_sync(v, ray_agent=True) == ("distributed" if torch.cuda.is_available() else "disk")
    s = load_config("cpu_demo", ["rollout.engine=sglang"]).rollout
    assert resolve_weight_sync(s, ray_agent=True) == resolve_weight_sync(s) == "distributed"  # gloo on CPU
    assert AgentConfig(parallel=ParallelConfig(pp=2)).uses_ray_workers and not AgentConfig().uses_ray_workers
    assert not AgentConfig(backend="hf", parallel=ParallelConfig(pp=2)).uses_ray_workers


EVENTS: list[tuple] = []  # what the fake vLLM servers and transfers saw, in order (one process, threads)
_EVENTS_LOCK = threading.Lock()


def record(*event) -> None:
    with _EVENTS_LOCK:
        EVENTS.append(event)


class FakeVLLM:
    """A vLLM client as the controller sees it (health, one update around every stage's chunks)."""

    base_url, tp_size = "http://vllm0", 1

    def health(self) -> bool:
        return True

    def start_weight_update(self) -> None:
        record("start")

    def finish_weight_update(self, version: int) -> None:
        record("finish", version)

    def detached(self):
        return self


class FakeTransfer:
    """Stands for one stage's VLLMNCCLTransport (CUDA only): records its push and its shutdown."""

    def __init__(self, updates: bool) -> None:
        self.updates, self.bytes_sent = updates, 0

    def push(self, engines, named_tensors, version: int) -> int:
        tensors = list(named_tensors)
        record("open")  # init_weight_transfer with this stage's sender as rank 0
        self.bytes_sent = nbytes(t for _, t in tensors)
        record("chunks", {stage_of(n) for n, _ in tensors})
        return len(tensors)

    def close(self) -> None:
        record("shutdown")


def test_vllm_stages_take_one_turn_each_inside_one_update(monkeypatch):
    from hacrl_megatron.sync import vllm_stages

    monkeypatch.setattr(vllm_stages.VLLMStageSenderFactory, "transport",
                        lambda self, role: FakeTransfer(updates=False))
    pushed = dict(tiny_llama(40, seed=5, tie=False).state_dict())
    ranks = StageRanks(pushed)
    transport = vllm_stages.VLLMStageTransport(BUCKET_BYTES, ranks=ranks, store=shared_store)
    EVENTS.clear()
    assert transport.push([FakeVLLM()], UnreadExport(ranks), version=7) == len(pushed)
    assert EVENTS[0] == ("start",) and EVENTS[-1] == ("finish", 7)
    turns = EVENTS[1:-1]  # each stage: open, all its chunks, shutdown, before the next stage opens
    assert [e[0] for e in turns] == ["open", "chunks", "shutdown"] * 2
    assert sorted(next(iter(e[1])) for e in turns if e[0] == "chunks") == [0, 1]
    assert [o.bytes_sent for o in ranks.outcomes] == [
        nbytes(t for n, t in pushed.items() if stage_of(n) == 0), 0, nbytes(t for n, t in pushed.items() if stage_of(n) == 1), 0]
    transport.close()
