"""MoE LocalAgents in one process: log-probs equal HF, the router losses' scale for our summed loss
(the same gradient whatever the micro-batching), their logged values, and routing replay kept per
agent (megatron-core's RouterReplay instance list is process-global)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from hacrl_megatron.agents.batch import SequenceBatch  # noqa: E402
from hacrl_megatron.agents.local import LocalAgent  # noqa: E402
from hacrl_megatron.agents.moe import RoutingReplayError, routers  # noqa: E402
from hacrl_megatron.config import AgentConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from tests.distributed.megatron_helpers import hf_seq_logprobs, sample_batch, sft_loss  # noqa: E402
from tests.distributed.moe_helpers import make_tiny_moe  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    make_tiny_moe("qwen3_moe", str(path), seed=2)
    return str(path)


def _agent(hf_dir: str, name: str = "m", mbs: int = 4, lr: float = 1e-3, **model_kw) -> LocalAgent:
    cfg = AgentConfig(name=name, model=ModelConfig(arch="qwen3_moe", hf_path=hf_dir, **model_kw), lr=lr,
                      parallel=ParallelConfig())
    return LocalAgent(cfg, TrainConfig(micro_batch_size=mbs, grad_clip=0.0))


def _grads(agent: LocalAgent) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in agent.module.named_parameters()}


def test_logprobs_equal_hf(hf_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    batch = sample_batch()
    with torch.no_grad():
        ref = hf_seq_logprobs(hf, batch, temperature=0.7)
    lp, _ = _agent(hf_dir).sequence_logprobs(batch, temperature=0.7)
    assert float((lp - ref).abs().max()) <= 1e-5


def _doubled(batch: SequenceBatch) -> SequenceBatch:
    return SequenceBatch(input_ids=batch.input_ids * 2, prompt_lens=torch.cat([batch.prompt_lens] * 2),
                         loss_inputs=batch.loss_inputs.select(list(range(len(batch))) * 2))


def test_router_loss_gradient_is_a_token_weighted_mean(hf_dir):
    """The batch X as one micro-batch and X + X as two micro-batches give the same gradient with the
    load-balancing and z-losses on: each is a mean over the mini-batch's tokens, as the policy loss is
    a mean over its sequences. Unscaled (megatron's per-micro-batch token factor kept) the router
    terms would be N times too large and doubled by the second micro-batch."""
    batch = sample_batch()
    kw = dict(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.05)
    one = _agent(hf_dir, mbs=4, **kw)
    (m1,) = one.train([batch], sft_loss)
    two = _agent(hf_dir, mbs=4, **kw)
    (m2,) = two.train([_doubled(batch)], sft_loss)
    plain = _agent(hf_dir, mbs=4)
    (m0,) = plain.train([batch], sft_loss)
    g1, g2, g0 = _grads(one), _grads(two), _grads(plain)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-5, atol=1e-7, msg=name)
    router = next(n for n in g1 if n.endswith("mlp.router.weight"))
    assert float((g1[router] - g0[router]).abs().max()) > 1e-4  # the router terms do reach the router
    assert m1["moe/aux_loss"] == pytest.approx(m2["moe/aux_loss"], rel=1e-6)
    assert m1["moe/z_loss"] == pytest.approx(m2["moe/z_loss"], rel=1e-6)
    assert "moe/aux_loss" not in m0 and m0["moe/aux_loss_coeff"] == 0.0


def _router_terms(router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, z) of one router on its input ``x`` [T, B, h], differentiable: Switch eq. 4 with f_e the
    share of tokens choosing e (counts are constants), ST-MoE eq. 5."""
    logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(), router.weight.float())
    probs = torch.softmax(logits, dim=-1)
    e, k = probs.shape[1], router.topk
    chosen = torch.zeros_like(probs).scatter(1, probs.detach().topk(k, dim=-1).indices, 1.0)
    return e / k * (chosen.mean(0) * probs.mean(0)).sum(), torch.logsumexp(logits, -1).square().mean()


def test_router_loss_gradient_is_exactly_the_coefficients_times_the_mean(hf_dir):
    """With coefficients (a, z) the update's gradient is that of policy loss + a·Σ_layers aux_l +
    z·Σ_layers z_l for one micro-batch, each router term a mean over the micro-batch's tokens: the
    same gradient computed by autograd from the routers' inputs on an agent with the terms off."""
    batch = sample_batch()
    a, z = 0.3, 0.02
    megatron_side = _agent(hf_dir, mbs=4, moe_aux_loss_coeff=a, moe_z_loss_coeff=z)
    megatron_side.train([batch], sft_loss)
    manual = _agent(hf_dir, mbs=4)
    seen = []
    hooks = [r.register_forward_hook(lambda m, args, out: seen.append((m, args[0]))) for r in routers(manual.module)]

    def loss_with_router_terms(lp, inputs, info):
        loss, metrics = sft_loss(lp, inputs, info)
        for router, x in seen:
            aux, zl = _router_terms(router, x)
            loss = loss + a * aux + z * zl
        return loss, metrics

    manual.train([batch], loss_with_router_terms)
    for h in hooks:
        h.remove()
    assert len(seen) == 2
    g_megatron, g_manual = _grads(megatron_side), _grads(manual)
    for name in g_manual:
        torch.testing.assert_close(g_megatron[name], g_manual[name], rtol=1e-4, atol=1e-6, msg=name)


def test_logged_router_losses_equal_their_definition(hf_dir):
    """moe/aux_loss = E/k · Σ_e f_e P_e (Switch eq. 4, f_e: share of the k·T assignments, P_e: mean
    router probability) and moe/z_loss = mean_t logsumexp(logits_t)² (ST-MoE eq. 5), both averaged over
    the MoE layers, from the router inputs of the update's forward."""
    agent = _agent(hf_dir, mbs=4, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    inputs = []
    hooks = [r.register_forward_hook(lambda m, a, o: inputs.append((m, a[0].detach().clone(), m.weight.detach().clone())))
             for r in routers(agent.module)]  # the weights before the update's optimizer step
    (metrics,) = agent.train([sample_batch()], sft_loss)
    for h in hooks:
        h.remove()
    aux, z = [], []
    for router, x, weight in inputs:
        logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(), weight.float())
        probs = torch.softmax(logits, dim=-1)
        e, k = probs.shape[1], router.topk
        chosen = torch.zeros_like(probs).scatter(1, probs.topk(k, dim=-1).indices, 1.0)
        aux.append(e / k * float((chosen.mean(0) * probs.mean(0)).sum()))
        z.append(float(torch.logsumexp(logits, -1).square().mean()))
    assert len(aux) == 2  # one forward of one micro-batch, two MoE layers
    assert metrics["moe/aux_loss"] == pytest.approx(sum(aux) / 2, rel=1e-5)
    assert metrics["moe/z_loss"] == pytest.approx(sum(z) / 2, rel=1e-5)


def test_routing_replay_keeps_the_pi_old_experts(hf_dir):
    """With a large learning rate the experts of some tokens change after one update; with routing
    replay the second update of the step still routes every token as the π_old pass did."""
    batch = sample_batch()
    reference = _agent(hf_dir, name="r", mbs=4)
    maps = []
    hooks = [r.register_forward_hook(lambda m, a, o: maps.append(o[1].detach().clone())) for r in routers(reference.module)]
    reference.token_logprobs(batch)
    for h in hooks:
        h.remove()
    free = _agent(hf_dir, name="f", mbs=4, lr=0.3)
    free_maps = []
    hooks = [r.register_forward_hook(lambda m, a, o: free_maps.append(o[1].detach().clone())) for r in routers(free.module)]
    free.train([batch, batch], sft_loss)
    for h in hooks:
        h.remove()
    lens = torch.tensor([len(ids) for ids in batch.input_ids])
    real = (torch.arange(int(lens.max()))[:, None] < lens[None, :]).reshape(-1)  # [T·B], t-major like megatron
    same = lambda x, y: torch.equal(x[real], y[real])  # noqa: E731 (padding tokens are replayed as experts 0..k-1)
    assert any(not same(a, b) for a, b in zip(free_maps[2:], maps))  # update 2 routes differently
    replayed = _agent(hf_dir, name="p", mbs=4, lr=0.3, moe_routing_replay=True)
    replayed.token_logprobs(batch)  # the π_old pass records
    used = []
    hooks = [r.register_forward_hook(lambda m, a, o: used.append(o[1].detach().clone())) for r in routers(replayed.module)]
    replayed.train([batch, batch], sft_loss)
    for h in hooks:
        h.remove()
    assert len(used) == 4 and all(same(a, b) for a, b in zip(used[2:], maps))
    assert replayed._replay.routes == {}  # used up by the step's updates
    # a step without a π_old pass of this agent: its routes come from one no-grad pass before update 1
    seen = []
    hooks = [r.register_forward_hook(lambda m, a, o: seen.append(o[1].detach().clone())) for r in routers(replayed.module)]
    replayed.train([batch, batch], sft_loss)
    for h in hooks:
        h.remove()
    assert len(seen) == 6 and all(same(a, b) for a, b in zip(seen[4:], seen[:2]))  # record, update 1, update 2
    assert replayed.stats()["routing_replay_extra_sequences"] == 4.0


def test_routing_replay_scores_the_other_agents_responses_before_the_first_update(hf_dir):
    """The π_old pass covers the agent's own responses; the others' (HACPO uses their authors' π_old)
    are scored once at the start of train(), under the same weights, and replayed in their update."""
    batch = sample_batch()
    reference = _agent(hf_dir, name="r", mbs=2)
    maps = []
    hooks = [r.register_forward_hook(lambda m, a, o: maps.append(o[1].detach().clone())) for r in routers(reference.module)]
    reference.token_logprobs(batch.select([2, 3]))  # π_old routing of the "cross" sequences
    for h in hooks:
        h.remove()
    agent = _agent(hf_dir, mbs=2, lr=0.3, moe_routing_replay=True)
    agent.token_logprobs(batch.select([0, 1]))  # own responses
    used = []
    hooks = [r.register_forward_hook(lambda m, a, o: used.append(o[1].detach().clone())) for r in routers(agent.module)]
    agent.train([batch.select([0, 1]), batch.select([2, 3])], sft_loss)
    for h in hooks:
        h.remove()
    assert agent.stats()["routing_replay_extra_sequences"] == 2.0
    lens = torch.tensor([len(batch.input_ids[i]) for i in (2, 3)])
    real = (torch.arange(int(lens.max()))[:, None] < lens[None, :]).reshape(-1)
    assert len(used) == 6 and all(torch.equal(a[real], b[real]) for a, b in zip(used[4:], maps))


def test_routing_replay_names_a_sequence_without_routes(hf_dir):
    agent = _agent(hf_dir, mbs=4, moe_routing_replay=True)
    batch = sample_batch()
    agent.token_logprobs(batch.select([0, 1]))
    layout = agent._micro_layout(batch, 0)
    with pytest.raises(RoutingReplayError, match="no recorded experts for a training sequence of 9 tokens"):
        with agent._replay.replay(layout, agent.updates):
            agent._replay._before_forward(agent.module, ())


def test_two_moe_agents_in_one_process_keep_their_own_routes(hf_dir, tmp_path):
    """megatron-core appends every RouterReplay to one process-global list; each agent takes its own
    instances out of it, so recording with one agent never touches the other's routers."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    before = len(RouterReplay.global_router_replay_instances)
    other_dir = tmp_path / "other"
    make_tiny_moe("qwen3_moe", str(other_dir), seed=9, layers=3)
    a = _agent(hf_dir, name="a", moe_routing_replay=True)
    b = _agent(str(other_dir), name="b", moe_routing_replay=True)
    assert len(RouterReplay.global_router_replay_instances) == before
    assert (len(a._replay.instances), len(b._replay.instances)) == (2, 3)
    batch = sample_batch()
    a.token_logprobs(batch)
    assert len(a._replay.routes) == 4 and b._replay.routes == {}
    b.token_logprobs(batch.select([0]))
    assert len(b._replay.routes) == 1 and all(len(v) == 3 for v in b._replay.routes.values())
    assert all(len(v) == 2 for v in a._replay.routes.values())
    a.train([batch], sft_loss)  # replays a's own routes only
    b.train([batch.select([0])], sft_loss)


def test_reference_pass_records_no_routes(hf_dir):
    agent = _agent(hf_dir, moe_routing_replay=True)
    agent.keep_reference()
    agent.reference_token_logprobs(sample_batch())
    assert agent._replay.routes == {}


def test_routing_replay_of_packed_rows_records_and_replays_each_sequences_experts(hf_dir):
    """With ``train.pack_sequences`` several sequences share one row, each from its slot's start: the
    routes recorded from packed rows equal those of padded rows, sequence by sequence, and the update
    replays them at the packed positions (the router's output there is the recorded experts)."""
    batch = sample_batch(lens=(7, 5, 9, 6), prompts=(3, 2, 4, 1))

    def agent(packed: bool) -> LocalAgent:
        cfg = AgentConfig(name="p" if packed else "q", model=ModelConfig(arch="qwen3_moe", hf_path=hf_dir,
                          moe_routing_replay=True), lr=0.3, parallel=ParallelConfig())
        train = TrainConfig(micro_batch_size=4, grad_clip=0.0, max_tokens_per_microbatch=16, pack_sequences=packed)
        return LocalAgent(cfg, train)

    padded, packed = agent(False), agent(True)
    padded.token_logprobs(batch)
    packed.token_logprobs(batch)
    assert set(packed._replay.routes) == set(padded._replay.routes) and len(packed._replay.routes) == 4
    for key, routes in padded._replay.routes.items():
        assert all(torch.equal(a, b) for a, b in zip(packed._replay.routes[key], routes))
    layouts = packed._micro_layout(batch, 0)
    assert any(len(m.keys) > 1 for m in layouts) and all(m.rows == 1 for m in layouts)  # sequences share rows
    used = []
    hooks = [r.register_forward_hook(lambda m, a, o: used.append(o[1].detach().clone())) for r in routers(packed.module)]
    packed.train([batch], sft_loss)
    for h in hooks:
        h.remove()
    layers = len(packed._replay.instances)
    assert len(used) == layers * len(layouts)
    for j, layout in enumerate(layouts):  # megatron runs micro-batches in order, layers in order
        for layer in range(layers):
            routing = used[j * layers + layer].reshape(layout.t_max, -1)  # [T, E] routing map of the row
            for key, n, (_, start) in zip(layout.keys, layout.lengths, layout.places):
                chosen = routing[start : start + n].nonzero()[:, 1].reshape(n, -1)
                expected = padded._replay.routes[key][layer]  # = the packed agent's own (asserted above)
                assert torch.equal(chosen.sort(1).values, expected.long().sort(1).values)
