"""The engine seam with a second engine client: in-process HF engines (``rollout.engine: hf``) behind
the same EnginePool and the same disk transport as SGLang servers, no server and no HTTP.

Checked: two HF engines in one pool load every disk-synced version (the post-sync probe check of
the loop passes on each, and fails before the first sync); a training step changes what the
engines score, and the next sync makes them score like the trainer again; generation through the
pool equals an HF engine holding the trainer's weights, and seeded samples do not depend on how
the pool spread the prompts; a transport whose operations an engine lacks is refused when the
pool is built; the configuration path (``rollout.weight_sync: disk`` with the HF engine) builds
that pool.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hacrl_megatron.agents.batch import SequenceBatch
from hacrl_megatron.agents.hf import HFAgent
from hacrl_megatron.config import ConfigError, load_config
from hacrl_megatron.exchange import load_tokenizer
from hacrl_megatron.rollout import EngineError, EnginePool, HFEngine, SamplingParams
from hacrl_megatron.sync import WeightSyncError, check_sync, sync_weights
from hacrl_megatron.sync.disk import DiskTransport
from hacrl_megatron.sync.tensor import TensorTransport
from tests.distributed.megatron_helpers import sft_loss, weights
from tests.unit.test_rollout_hf import QUESTIONS, tiny_llama

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0, max_new_tokens=6)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("char", tmp_path_factory.mktemp("tok"))


def prompts(tok):
    return [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]


def hf_pool(tok, transport, n=2, seed=0):
    engines = [HFEngine(tiny_llama(len(tok), seed=seed), tok, name=f"engine{k}") for k in range(n)]
    return EnginePool(engines, transport, name="a")


def sft_batch(tok) -> SequenceBatch:
    """The probe questions with a fixed answer each, weighted 1 (an SFT step moves every score)."""
    ids = [tok(q + " 7", add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    lens = [len(tok(q, add_special_tokens=False)["input_ids"]) for q in QUESTIONS]
    return SequenceBatch(input_ids=tuple(torch.tensor(i) for i in ids), prompt_lens=torch.tensor(lens),
                         loss_inputs=weights(torch.ones(len(ids))))


def test_two_hf_engines_take_disk_syncs_through_the_pool(tok, tmp_path):
    pool = hf_pool(tok, DiskTransport(tmp_path / "sync", shard_bytes=20_000))
    agent = HFAgent("a", tiny_llama(len(tok), seed=4), lr=1e-2)
    prompt, response = prompts(tok)[0], prompts(tok)[1][:6]
    with pytest.raises(WeightSyncError, match="after weight sync the engine's log-prob"):
        check_sync(agent, pool, prompt, response)  # the engines still hold other weights

    assert sync_weights(agent, pool) == len(agent.model.state_dict())
    assert pool.weight_version == 1 and [e.weight_version for e in pool.engines] == [1, 1]
    assert len(list((tmp_path / "sync" / "v1").glob("model-*.safetensors"))) > 1  # sharded, read file by file
    for engine in pool.engines:  # the loop's check passes on every engine, not only the first
        assert check_sync(agent, engine, prompt, response) < 1e-4
    before = [e.sequence_logprob(prompt, response) for e in pool.engines]

    agent.train([sft_batch(tok)], sft_loss)
    stale = [e.sequence_logprob(prompt, response) for e in pool.engines]
    assert stale == before  # the engines change only through weight sync
    assert sync_weights(agent, pool) == len(agent.model.state_dict())
    after = [e.sequence_logprob(prompt, response) for e in pool.engines]
    assert all(abs(a - b) > 1e-3 for a, b in zip(after, before))  # the step moved the engines' scores
    assert check_sync(agent, pool, prompt, response) < 1e-4
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["v2"]  # the previous folder is gone

    expected = HFEngine(copy.deepcopy(agent.model), tok).generate(prompts(tok), GREEDY)
    assert pool.generate(prompts(tok), GREEDY) == expected
    stats = pool.stats()
    assert stats["weight_version"] == 2 and stats["restarts"] == 0 and stats["sequences"] == len(QUESTIONS)
    pool.close()


def test_seeded_samples_do_not_depend_on_how_the_pool_spreads_prompts(tok, tmp_path):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=9)
    one, many = hf_pool(tok, DiskTransport(tmp_path / "one"), n=1), hf_pool(tok, DiskTransport(tmp_path / "many"), n=3)
    got_one, got_many = one.generate(prompts(tok), params), many.generate(prompts(tok), params)
    assert got_one == got_many
    assert len({c.token_ids for group in got_one for c in group}) > 3  # distinct seeds, distinct samples
    assert one.generate(prompts(tok), params) == got_one  # reproducible
    with pytest.raises(ValueError, match="5 seeds for 4 prompts × n=3"):
        one.engines[0].generate_seeded(prompts(tok), params, seeds=[1, 2, 3, 4, 5])


def test_a_transport_the_engine_cannot_take_is_refused_when_the_pool_is_built(tok):
    with pytest.raises(ValueError, match=r"engine 'engine0' \(HFEngine\) cannot take weights by tensor: it lacks "
                                         r"\['tp_size', 'update_weights_from_tensor'\]"):
        hf_pool(tok, TensorTransport(), n=1)
    with pytest.raises(EngineError, match="in-process engine cannot be restarted"):
        HFEngine(tiny_llama(len(tok)), tok).restart()


def test_hf_engine_with_disk_sync_from_the_configuration(tmp_path):
    from hacrl_megatron.trainer.runtime import build_runtime

    exp = load_config("cpu_demo", ["rollout.weight_sync=disk", f"output_dir={tmp_path / 'run'}"])
    rt = build_runtime(exp, 0, total_updates=1)
    try:
        assert isinstance(rt.engine, EnginePool) and isinstance(rt.engine.transport, DiskTransport)
        assert [type(e).__name__ for e in rt.engine.engines] == ["HFEngine"]
        assert rt.sync_weights() == len(list(rt.trainer.export_hf_weights()))
        assert (tmp_path / "run" / "engines" / rt.name / "synced" / "v1").is_dir()
        prompt, response = rt.prompt_ids("3+4=?"), rt.tokenizer.encode("\\boxed{7}")
        assert check_sync(rt.trainer, rt.engine, prompt, response) < 1e-4
    finally:
        rt.close()
    default = build_runtime(load_config("cpu_demo", [f"output_dir={tmp_path / 'run2'}"]), 0, total_updates=1)
    assert isinstance(default.engine, HFEngine)  # auto: the engine copies the trainer's tensors itself
    default.close()
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync='distributed': rollout\.engine=hf takes weights by "
                                          r"\['auto', 'inprocess', 'disk'\]"):
        load_config("cpu_demo", ["rollout.weight_sync=distributed"])
