"""The SGLang stand-in as a TP-2 engine: its weight-update group has one member per engine rank
(rank_offset, rank_offset + 1), every rank receives every broadcast bucket, and the pushed weights
are served; next to a TP-1 engine the trainer's world is 1 + 2 + 1."""

from __future__ import annotations

from hacrl_megatron.rollout import EnginePool, HFEngine, SGLangEngine
from hacrl_megatron.sync.distributed import DistributedTransport
from tests.fixtures.sglang_standin import StandIn
from tests.unit.test_rollout_hf import tiny_llama
from tests.unit.test_sync_transports import GREEDY, prompts, tok  # noqa: F401  (the module's tokenizer fixture)


def test_tp2_stand_in_joins_the_weight_group_with_two_ranks(tok, tmp_path):  # noqa: F811
    servers = [StandIn(lambda: HFEngine(tiny_llama(len(tok)), tok)) for _ in range(2)]
    for s in servers:
        s.start()
    servers[0].handler.tp_size = 2
    engines = [SGLangEngine(s.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=s, name=f"engine{k}",
                            timeout=60, tp_size=tp) for k, (s, tp) in enumerate(zip(servers, (2, 1)))]
    pool = EnginePool(engines, DistributedTransport(40_000, backend="gloo", group_name="tp", timeout_s=60), name="a")
    try:
        other = tiny_llama(len(tok), seed=1)
        pool.load_weights(other.state_dict().items())
        inits = [[r for p, r in s.log if p == "/init_weights_update_group"][0] for s in servers]
        assert [(i["rank_offset"], i["world_size"]) for i in inits] == [(1, 4), (3, 4)]
        expected = HFEngine(other, tok).generate(prompts(tok), GREEDY)
        assert all(e.generate(prompts(tok), GREEDY) == expected for e in pool.engines)
        assert len(servers[0].handler.state.groups[inits[0]["group_name"]]) == 2  # one member per TP rank
        assert servers[0].handler.state.buckets_received > 0
    finally:
        pool.close()
