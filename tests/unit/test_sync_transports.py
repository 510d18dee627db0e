"""Weight transports (sync/disk.py, sync/tensor.py, sync/distributed.py over gloo) and EnginePool,
against in-process stand-in SGLang servers (tests/fixtures/fake_sglang_server.py) that validate
every request against each SGLang release's contract and load the received tensors into a real
tiny HF model: after a push every engine must generate exactly what an HF engine holding the
pushed weights generates, and the post-sync probe check must pass."""

from __future__ import annotations

import pytest
import torch

from hacrl_megatron.agents.hf import HFAgent
from hacrl_megatron.exchange import load_tokenizer
from hacrl_megatron.rollout import EnginePool, HFEngine, SamplingParams, SGLangEngine
from hacrl_megatron.sync import WeightSyncError, check_sync, sync_weights
from hacrl_megatron.sync.base import buckets, with_last
from hacrl_megatron.sync.disk import DiskTransport
from hacrl_megatron.sync.distributed import DistributedTransport
from hacrl_megatron.sync.tensor import TensorTransport
from hacrl_megatron.sync.weight_group import flatten_bucket, unflatten_bucket
from tests.fixtures.sglang_standin import StandIn
from tests.fixtures.sglang_validator import VERSIONS
from tests.unit.test_rollout_hf import QUESTIONS, tiny_llama

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("char", tmp_path_factory.mktemp("tok"))


def prompts(tok):
    return [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]


def make_transport(kind: str, tmp_path, bucket_bytes: int = 40_000):
    if kind == "disk":
        return DiskTransport(tmp_path / "sync", shard_bytes=bucket_bytes)
    if kind == "tensor":
        return TensorTransport(bucket_bytes)
    return DistributedTransport(bucket_bytes, backend="gloo", group_name="test", timeout_s=60)


def make_pool(tok, kind, tmp_path, n_engines=2, version=VERSIONS[-1], colocate=False, **kw):
    servers = [StandIn(lambda: HFEngine(tiny_llama(len(tok)), tok), version=version, **kw) for _ in range(n_engines)]
    for s in servers:
        s.start()
    engines = [SGLangEngine(s.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=s, name=f"engine{k}",
                            timeout=60) for k, s in enumerate(servers)]
    return EnginePool(engines, make_transport(kind, tmp_path), colocate=colocate, name="a"), servers


def test_buckets_keep_order_split_by_size_and_dtype():
    ts = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("c", torch.zeros(30)), ("d", torch.zeros(2, dtype=torch.bfloat16)),
          ("e", torch.zeros(3))]
    got = [[n for n, _ in b] for b in buckets(iter(ts), bucket_bytes=80)]
    assert got == [["a", "b"], ["c"], ["d"], ["e"]]  # c (120 B) alone; a dtype change starts a bucket
    assert list(with_last("xyz")) == [("x", False), ("y", False), ("z", True)] and list(with_last([])) == []
    flat, meta = flatten_bucket([("w", torch.arange(6.0).reshape(2, 3)), ("v", torch.tensor([7.0]))])
    assert flat.dtype == torch.uint8 and flat.numel() == 28
    assert meta == {"names": ["w", "v"], "dtypes": ["float32", "float32"], "shapes": [[2, 3], [1]]}
    back = unflatten_bucket(flat, **meta)
    assert torch.equal(back[0][1], torch.arange(6.0).reshape(2, 3)) and torch.equal(back[1][1], torch.tensor([7.0]))
    with pytest.raises(ValueError, match="cover 24 bytes, the bucket has 28"):
        unflatten_bucket(flat, ["w"], ["float32"], [[2, 3]])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind", ["disk", "tensor", "distributed"])
def test_transport_loads_every_engine(tok, tmp_path, kind, version):
    pool, servers = make_pool(tok, kind, tmp_path, version=version)
    try:
        before = pool.generate(prompts(tok), GREEDY)
        other = tiny_llama(len(tok), seed=1)
        state = dict(other.state_dict())
        assert pool.load_weights(state.items()) == len(state)
        expected = HFEngine(other, tok).generate(prompts(tok), GREEDY)
        assert expected != before
        for engine in pool.engines:  # every engine holds the pushed weights
            assert engine.generate(prompts(tok), GREEDY) == expected
        assert pool.generate(prompts(tok), GREEDY) == expected and pool.weight_version == 1
        path = {"disk": "/update_weights_from_disk", "tensor": "/update_weights_from_tensor",
                "distributed": "/update_weights_from_distributed"}[kind]
        for server in servers:
            reqs = [r for p, r in server.log if p == path]
            if kind == "disk":
                assert reqs == [{"model_path": str(tmp_path / "sync" / "v1"), "weight_version": "1"}]
            else:  # several buckets, only the last one flushes the cache
                assert len(reqs) > 2 and [r["flush_cache"] for r in reqs] == [False] * (len(reqs) - 1) + [True]
                if kind == "distributed":
                    assert [n for r in reqs for n in r["names"]] == list(state)  # every tensor once, in order
    finally:
        pool.close()


def test_distributed_group_is_built_once_and_rebuilt_after_a_restart(tok, tmp_path):
    pool, servers = make_pool(tok, "distributed", tmp_path)
    try:
        other = tiny_llama(len(tok), seed=1)
        pool.load_weights(other.state_dict().items())
        pool.load_weights(other.state_dict().items())
        inits = [[r for p, r in s.log if p == "/init_weights_update_group"] for s in servers]
        assert [len(i) for i in inits] == [1, 1]
        assert [(i[0]["rank_offset"], i[0]["world_size"], i[0]["backend"]) for i in inits] == [(1, 3, "gloo"),
                                                                                              (2, 3, "gloo")]
        group = inits[0][0]["group_name"]
        assert all(r["group_name"] == group and r["load_format"] == "flattened_bucket"
                   for p, r in servers[1].log if p == "/update_weights_from_distributed")
        servers[1].kill()
        pool.slots[1].engine.restart()
        assert not pool.transport.restore(pool.slots[1].engine, 2)  # it left the group: rebuilt at the next push
        third = tiny_llama(len(tok), seed=2)
        pool.load_weights(third.state_dict().items())
        assert [p for p, _ in servers[0].log].count("/destroy_weights_update_group") == 1
        assert [p for p, _ in servers[0].log].count("/init_weights_update_group") == 2
        expected = HFEngine(third, tok).generate(prompts(tok), GREEDY)
        assert all(e.generate(prompts(tok), GREEDY) == expected for e in pool.engines)
    finally:
        pool.close()


def test_disk_transport_keeps_only_the_last_complete_folder(tok, tmp_path):
    transport = DiskTransport(tmp_path / "sync", shard_bytes=10_000)
    model = tiny_llama(len(tok))
    folder, count = transport.write(model.state_dict().items(), 1)
    assert count == len(model.state_dict()) and len(list(folder.glob("model-*.safetensors"))) > 2
    assert (folder / "model.safetensors.index.json").exists()
    pool, servers = make_pool(tok, "disk", tmp_path, n_engines=1)
    try:
        pool.load_weights(model.state_dict().items())
        pool.load_weights(tiny_llama(len(tok), seed=3).state_dict().items())
        assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["v2"]
    finally:
        pool.close()


def test_colocated_pool_releases_and_resumes_around_the_sync(tok, tmp_path):
    pool, servers = make_pool(tok, "tensor", tmp_path, n_engines=1, colocate=True)
    try:
        pool.release_memory()
        other = tiny_llama(len(tok), seed=1)
        pool.load_weights(other.state_dict().items())
        calls = [(p, r) for p, r in servers[0].log if p not in ("/update_weights_from_tensor", "/server_info")]
        assert calls == [("/release_memory_occupation", {}), ("/resume_memory_occupation", {"tags": ["weights"]}),
                         ("/begin_weight_update", {}), ("/end_weight_update", {}),  # the push's session
                         ("/resume_memory_occupation", {"tags": ["kv_cache"]})]
        pool.release_memory()
        assert pool.generate(prompts(tok), GREEDY) == HFEngine(other, tok).generate(prompts(tok), GREEDY)
        assert servers[0].log[-2] == ("/resume_memory_occupation", {})  # generating resumed everything first
    finally:
        pool.close()


def test_colocated_pool_leaves_the_kv_cache_to_a_caller_that_resumed_the_weights(tok, tmp_path):
    """The colocation schedule's sync (trainer/colocation.py): weights back, push, then (after the trainer's
    weights left the GPU) the KV cache alone; a release asks only for what is held."""
    pool, servers = make_pool(tok, "tensor", tmp_path, n_engines=1, colocate=True)
    try:
        pool.release_memory()
        pool.resume_memory(["weights"])
        other = tiny_llama(len(tok), seed=1)
        pool.load_weights(other.state_dict().items())
        pool.resume_memory()  # only the KV cache is still released
        pool.resume_memory()  # nothing left: no request
        pool.resume_memory(["weights"])
        pool.release_memory()
        pool.resume_memory(["weights"])
        pool.release_memory()  # the KV cache is still released: the weights alone
        calls = [(p, r) for p, r in servers[0].log if p.endswith("_memory_occupation")]
        assert calls == [("/release_memory_occupation", {}), ("/resume_memory_occupation", {"tags": ["weights"]}),
                         ("/resume_memory_occupation", {"tags": ["kv_cache"]}), ("/release_memory_occupation", {}),
                         ("/resume_memory_occupation", {"tags": ["weights"]}),
                         ("/release_memory_occupation", {"tags": ["weights"]})]
        pool.resume_memory()
        assert pool.generate(prompts(tok), GREEDY) == HFEngine(other, tok).generate(prompts(tok), GREEDY)
    finally:
        pool.close()


@pytest.mark.parametrize("kind", ["disk", "distributed"])
def test_probe_check_after_sync_from_an_agent(tok, tmp_path, kind):
    pool, _ = make_pool(tok, kind, tmp_path, n_engines=1)
    try:
        agent = HFAgent("a", tiny_llama(len(tok), seed=4), lr=1e-3)
        prompt, response = prompts(tok)[0], prompts(tok)[1][:6]
        with pytest.raises(WeightSyncError, match="after weight sync the engine's log-prob"):
            check_sync(agent, pool, prompt, response)  # the engine still has other weights
        assert sync_weights(agent, pool) == len(agent.model.state_dict())
        assert check_sync(agent, pool, prompt, response) < 1e-4
    finally:
        pool.close()


def test_a_server_refusing_the_group_fails_the_push_at_once(tok, tmp_path):
    """The stand-in refuses NCCL (no GPU): the push fails with its reply instead of waiting out the
    600 s rendezvous timeout for a rank that will never come."""
    pool, servers = make_pool(tok, "distributed", tmp_path, n_engines=1)
    pool.transport = DistributedTransport(40_000, backend="nccl", group_name="refused", timeout_s=600)
    try:
        with pytest.raises(Exception, match="(?i)nccl"):
            pool.load_weights(tiny_llama(len(tok), seed=1).state_dict().items())
    finally:
        pool.close()
