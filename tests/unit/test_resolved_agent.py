"""An agent is resolved once (models/resolved.py): a run's setup reads each agent's HF ``config.json``
exactly once, and hands that record to the model load, the trainer (Ray ranks too) and the engines.

Reads are counted where transformers reads every ``config.json``: ``PretrainedConfig.get_config_dict``
(``AutoConfig.from_pretrained``, and a model's ``from_pretrained`` that is given no config). Before
the record existed the demo read each warm-up's config once (inside ``from_pretrained``), but a
Megatron agent on an HF folder with server engines read its config twice in the controller
(``model_hf_config`` and ``LocalAgent``'s own check), a third time for a CPU vLLM server, and once
more on every Ray rank.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from pathlib import Path

import pytest
from transformers import PretrainedConfig

from hacrl_megatron.config import TrainConfig, load_config, validate
from hacrl_megatron.models.resolved import resolve_agent
from hacrl_megatron.trainer import loop
from hacrl_megatron.trainer.runtime import reads_weights_itself
from tests.distributed.megatron_helpers import make_tiny_hf
from tests.e2e.test_trainer import tiny_exp

FAKE_SERVER = Path(__file__).resolve().parents[1] / "fixtures" / "fake_sglang_server.py"


@pytest.fixture()
def config_reads(monkeypatch):
    """Folder (resolved) → how many times transformers read its config.json."""
    reads: collections.Counter[str] = collections.Counter()
    original = PretrainedConfig.__dict__["get_config_dict"].__func__

    def counting(cls, path, *args, **kwargs):
        reads[str(Path(path).resolve())] += 1
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(PretrainedConfig, "get_config_dict", classmethod(counting))
    return reads


def close(run: loop.Run) -> None:
    run.source.close()
    run.verifier.close()
    for rt in run.runtimes:
        rt.close()


def test_the_demo_setup_reads_each_agents_config_once(tmp_path, config_reads):
    exp = load_config("cpu_demo", [f"output_dir={tmp_path / 'run'}", "train.steps=1", "train.eval_every=0",
                                   "data.eval_size=0"])
    run = loop.setup(exp)  # both agents start from their (shipped or cached) warm-up folders
    try:
        folders = [str(rt.resolved.weights.resolve()) for rt in run.runtimes]
        assert len(set(folders)) == 2
        assert dict(config_reads) == dict.fromkeys(folders, 1)
        for rt in run.runtimes:  # the trainer was built from the record: the same architecture
            assert rt.trainer.spec == rt.resolved.spec and rt.resolved.dtype == "float32"
    finally:
        close(run)


def test_a_megatron_agent_on_a_folder_with_server_engines_reads_its_config_once(tmp_path, config_reads):
    folder = tmp_path / "llama-hf"
    make_tiny_hf("llama", str(folder), vocab=128)
    exp = tiny_exp(tmp_path, backend="megatron")
    command = [sys.executable, str(FAKE_SERVER), "--model-path", "{model_path}", "--host", "{host}", "--port", "{port}"]
    first = dataclasses.replace(exp.agents[0], model=dataclasses.replace(exp.agents[0].model, hf_path=str(folder)))
    exp = validate(dataclasses.replace(exp, agents=[first, exp.agents[1]], rollout=dataclasses.replace(
        exp.rollout, engine="sglang", weight_sync="disk", sglang=dataclasses.replace(exp.rollout.sglang, command=command))))
    assert reads_weights_itself(exp, exp.agents[0])  # the controller never loads the model
    config_reads.clear()
    run = loop.setup(exp)
    try:
        assert dict(config_reads) == {str(folder.resolve()): 1}  # the second agent is built from its sizes
        llama = run.runtimes[0]
        assert llama.trainer.spec == llama.resolved.spec and llama.trainer.hf_config is llama.resolved.hf_config
    finally:
        close(run)


def test_a_rank_given_the_record_reads_no_config(tmp_path, config_reads):
    """What every Ray rank does (agents/ray_worker.WorkerSetup carries the record): the folder's
    safetensors are read, its config.json is not."""
    from hacrl_megatron.agents.local import LocalAgent

    folder = tmp_path / "qwen3-hf"
    make_tiny_hf("qwen3", str(folder), vocab=128)
    cfg = tiny_exp(tmp_path, backend="megatron").agents[1]
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=str(folder)))
    agent = resolve_agent(cfg, 100)
    assert dict(config_reads) == {str(folder.resolve()): 1}
    local = LocalAgent(agent.cfg, TrainConfig(), hf_checkpoint=str(folder), hf_config=agent.hf_config, resolved=agent)
    assert dict(config_reads) == {str(folder.resolve()): 1}
    assert local.spec == agent.spec
