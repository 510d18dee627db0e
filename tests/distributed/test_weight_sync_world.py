"""Distributed weight sync from a Megatron agent's gloo world into stand-in SGLang servers.

Every rank of a TP = 2 (2 processes) or TP = 2 · PP = 2 (4 processes) agent iterates its own
``export_hf_weights()`` stream (TP all-gathers, PP broadcasts); rank 0 cuts it into flattened
buckets and broadcasts them over a separate gloo group to two stand-in servers running in this
pytest process (tests/fixtures/fake_sglang_server.py: it joins the group with its own replica of
SGLang's rendezvous and slices each bucket independently of sync/distributed.py). Each server's HF
model must then equal the HF checkpoint the agent was built from, bit for bit, and the buckets
must respect the size limit and carry every tensor once, in export order. qwen2 (untied LM head,
QKV biases, vocabulary 97 padded to 98 at TP = 2) exercises every conversion rule.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from hacrl_megatron.rollout import HFEngine  # noqa: E402
from tests.distributed.megatron_helpers import (  # noqa: E402
    agent_config,
    make_tiny_hf,
    run_world,
    tiny_hf_config,
    train_config,
)
from tests.fixtures.sglang_standin import StandIn  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]
BUCKET_BYTES = 6000  # tiny, so that a 2-layer model needs many buckets (a few tensors each)


def _sync_world(rank: int, hf_dir: str, urls: list[str], tp: int, pp: int) -> dict:
    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.rollout import SGLangEngine
    from hacrl_megatron.sync.distributed import DistributedTransport, push_from_rank

    agent = LocalAgent(agent_config("qwen2", hf_dir, tp=tp, pp=pp), train_config())
    transport, engines = None, []
    if rank == 0:
        transport = DistributedTransport(BUCKET_BYTES, backend="gloo", group_name="world_test", timeout_s=120)
        engines = [SGLangEngine(u, eos_token_id=0, name=f"engine{k}", timeout=120) for k, u in enumerate(urls)]
    count = push_from_rank(agent.export_hf_weights(), transport, engines, version=1)
    out = {"count": count}
    if transport is not None:
        out.update(buckets=transport.buckets_sent, bytes=transport.bytes_sent)
        transport.close()
    return out


def _receiver() -> HFEngine:
    torch.manual_seed(123)  # different weights from the agent's
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("qwen2"), dtype=torch.float32)
    return HFEngine(model, SimpleNamespace(eos_token_id=0, pad_token_id=0))


@pytest.mark.parametrize("tp, pp", [pytest.param(2, 1, id="tp2"),
                                    pytest.param(2, 2, id="tp2pp2", marks=pytest.mark.slow)])
def test_buckets_rebuild_the_hf_state_dict_bit_identically(tmp_path, tp, pp):
    torch.set_num_threads(1)
    hf_dir = os.path.join(tmp_path, "qwen2")
    reference = {k: v.clone() for k, v in make_tiny_hf("qwen2", hf_dir, seed=2).state_dict().items()}
    servers = [StandIn(_receiver) for _ in range(2)]
    for s in servers:
        s.start()
    try:
        before = servers[0].handler.state.backend.model.state_dict()
        assert not torch.equal(before["model.embed_tokens.weight"], reference["model.embed_tokens.weight"])
        result = run_world(_sync_world, tp * pp, (hf_dir, [s.base_url for s in servers], tp, pp), str(tmp_path))
        assert result["count"] == len(reference)
        for server in servers:
            state = server.handler.state.backend.model.state_dict()
            assert set(state) == set(reference)
            assert all(torch.equal(state[k], reference[k]) for k in reference), \
                [k for k in reference if not torch.equal(state[k], reference[k])]
            reqs = [r for p, r in server.log if p == "/update_weights_from_distributed"]
            assert len(reqs) == result["buckets"] > 5
            names = [n for r in reqs for n in r["names"]]
            assert sorted(names) == sorted(reference) and len(names) == len(set(names))
            for r in reqs:
                size = sum(torch.Size(s).numel() * getattr(torch, d).itemsize for s, d in zip(r["shapes"], r["dtypes"]))
                assert size <= BUCKET_BYTES or len(r["names"]) == 1
            assert [r["flush_cache"] for r in reqs][-2:] == [False, True]
            inits = [r for p, r in server.log if p == "/init_weights_update_group"]
            assert len(inits) == 1 and inits[0]["world_size"] == 3
        assert result["bytes"] == sum(v.numel() * v.element_size() for v in reference.values())
    finally:
        for s in servers:
            s.stop()
