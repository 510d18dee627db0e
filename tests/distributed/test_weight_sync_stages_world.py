"""Weight sync from every pipeline stage of a Megatron agent's gloo world (sync/stages.py) into stand-in servers.

A PP = 2 (2 processes) or TP = 2 · PP = 2 (4 processes, ``slow``) qwen2 agent, its weights moved off
the checkpoint it was built from (so that only a push can bring the servers there). Every rank runs
the code a Ray agent's rank runs (:class:`~hacrl_megatron.agents.ray_worker.RankWorker`:
``open_weight_sender`` with a :class:`~hacrl_megatron.sync.stages.StageSenderFactory`, then
``push_weights``): each stage's first TP rank joins a weight group of its own with the two stand-in
SGLang servers (tests/fixtures/fake_sglang_server.py, threads of this pytest process, each joining
with its own replica of SGLang's rendezvous) and broadcasts its stage's buckets, the stages taking
turns through the world's own store; rank 0 holds the servers' sessions, as the controller does.
Checked:

* each server then holds the agent's HF export (``export_hf_weights``, the rank-0 path's stream) bit
  for bit, every tensor received once, from the group of the stage that owns it;
* bytes, counted on each rank's send path (``PushOutcome``): a stage's sender broadcast exactly its
  stage's share, every rank held exactly its stage's share, and no rank the whole model (the rank-0
  path moves all of it through rank 0);
* no rank exported the whole model (``LocalAgent.export_hf_weights`` is never called by the push).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from hacrl_megatron.config.layout import pipeline_layers  # noqa: E402
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
BUCKET_BYTES = 6000  # tiny, so that each stage needs several buckets
LAYERS = 2


def _stages_world(rank: int, hf_dir: str, urls: list[str], tp: int, pp: int, out_dir: str) -> dict:
    import dataclasses
    from contextlib import ExitStack

    import torch.distributed as dist

    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.agents.ray_worker import RankWorker
    from hacrl_megatron.rollout import SGLangEngine
    from hacrl_megatron.sync.base import weight_update_session
    from hacrl_megatron.sync.stages import StageSenderFactory, stage_roles

    agent = LocalAgent(agent_config("qwen2", hf_dir, tp=tp, pp=pp), train_config())
    with torch.no_grad():  # weights neither the checkpoint nor the servers have (TP replicas stay equal)
        for p in agent.module.parameters():
            p.add_(0.125)
    infos: list = [None] * dist.get_world_size()
    dist.all_gather_object(infos, dataclasses.asdict(agent.info))
    factory = StageSenderFactory(stage_roles(infos), BUCKET_BYTES, "gloo", "stages_test", None, 120.0, {},
                                 "hacrl_weight_turns/stages_test/0")
    worker = RankWorker("a")
    worker.rank, worker._local = rank, agent
    worker.open_weight_sender(factory)
    engines = [SGLangEngine(u, eos_token_id=0, name=f"engine{k}", timeout=120) for k, u in enumerate(urls)]
    full_exports = []
    agent.export_hf_weights = lambda: full_exports.append(1) or iter(())  # the push must not call it
    with ExitStack() as sessions:
        if rank == 0:  # the controller's part: every engine's session around all stages
            sessions.enter_context(weight_update_session(engines))
        dist.barrier()
        outcome = worker.push_weights(engines, version=1)
        dist.barrier()
    del agent.export_hf_weights
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, {"part": outcome.part, "count": outcome.count, "held": outcome.bytes_held,
                                      "sent": outcome.bytes_sent, "error": repr(outcome.error) if outcome.error else None,
                                      "full_exports": len(full_exports)})
    exported = {n: t.clone() for n, t in agent.export_hf_weights()}  # the agent's HF export (collective)
    worker.close_weight_sender()
    if rank == 0:
        torch.save(exported, os.path.join(out_dir, "export.pt"))
    return {"outcomes": outcomes}


def _receiver() -> HFEngine:
    torch.manual_seed(123)  # other weights than the agent's
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("qwen2", layers=LAYERS), dtype=torch.float32)
    return HFEngine(model, SimpleNamespace(eos_token_id=0, pad_token_id=0))


def owning_stage(name: str, pp: int) -> int:
    """The pipeline stage that holds an HF tensor of the qwen2 agent."""
    if name.startswith("model.layers."):
        layer, first = int(name.split(".")[2]), 0
        for stage, count in enumerate(pipeline_layers(LAYERS, pp)):
            if layer < first + count:
                return stage
            first += count
    return 0 if name == "model.embed_tokens.weight" else pp - 1


@pytest.mark.parametrize("tp, pp", [pytest.param(1, 2, id="pp2"),
                                    pytest.param(2, 2, id="tp2pp2", marks=pytest.mark.slow)])
def test_every_stage_sends_its_share_and_the_servers_hold_the_agents_export_bit_identically(tmp_path, tp, pp):
    torch.set_num_threads(1)
    hf_dir = os.path.join(tmp_path, "qwen2")
    checkpoint = {k: v.clone() for k, v in make_tiny_hf("qwen2", hf_dir, seed=2).state_dict().items()}
    servers = [StandIn(_receiver) for _ in range(2)]
    for s in servers:
        s.start()
    try:
        result = run_world(_stages_world, tp * pp, (hf_dir, [s.base_url for s in servers], tp, pp, str(tmp_path)),
                           str(tmp_path))
        exported = torch.load(os.path.join(tmp_path, "export.pt"))
        assert set(exported) == set(checkpoint)
        assert not torch.equal(exported["model.norm.weight"], checkpoint["model.norm.weight"])  # moved off it
        share = [sum(t.numel() * t.element_size() for n, t in exported.items() if owning_stage(n, pp) == k)
                 for k in range(pp)]
        total = sum(share)
        outcomes = result["outcomes"]
        assert [o["error"] for o in outcomes] == [None] * (tp * pp)
        assert [o["full_exports"] for o in outcomes] == [0] * (tp * pp)
        for rank, o in enumerate(outcomes):  # megatron's rank order: TP fastest, then PP
            stage = rank // tp
            sends = rank % tp == 0
            assert (o["part"], o["held"], o["sent"]) == (f"stage{stage}", share[stage], share[stage] if sends else 0)
            assert o["held"] < total and o["sent"] < total
        counts = {o["part"]: o["count"] for o in outcomes}
        assert sum(counts.values()) == len(exported)
        for server in servers:
            state = server.handler.state.backend.model.state_dict()
            assert [k for k in exported if not torch.equal(state[k], exported[k])] == []
            reqs = [r for p, r in server.log if p == "/update_weights_from_distributed"]
            names = [n for r in reqs for n in r["names"]]
            assert sorted(names) == sorted(exported) and len(names) == len(set(names))
            for r in reqs:
                stage = int(r["group_name"].split("-stage")[1].split("-")[0])
                assert {owning_stage(n, pp) for n in r["names"]} == {stage}
            inits = [r for p, r in server.log if p == "/init_weights_update_group"]
            assert len(inits) == pp and {i["world_size"] for i in inits} == {3}
        # the stages took turns: no two stages' buckets were on the wire at once, on either server
        receives = sorted((start, end, g) for s in servers for g, start, end in s.handler.state.receives)
        assert [(a, b) for i, a in enumerate(receives) for b in receives[i + 1:] if a[2] != b[2] and b[0] < a[1]] == []
    finally:
        for s in servers:
            s.stop()
