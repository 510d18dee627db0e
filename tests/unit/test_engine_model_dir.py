"""The folder engine servers start from (rollout/servers.engine_model_dir) and which agents the controller
never loads (trainer/runtime.reads_weights_itself): an HF folder is linked file by file, never copied or
loaded, the agent's tokenizer is written (never through a link into the user's folder), and a rerun
replaces what an earlier one left."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from hacrl_megatron.exchange.tokenizers import load_tokenizer
from hacrl_megatron.rollout.servers import engine_model_dir, model_hf_config
from hacrl_megatron.trainer.runtime import load_hf_model, reads_weights_itself
from tests.e2e.test_trainer import tiny_exp


@pytest.fixture()
def hf_folder(tmp_path):
    exp = tiny_exp(tmp_path)
    cfg = exp.agents[0]
    tok = load_tokenizer(cfg.tokenizer)
    model = load_hf_model(cfg, len(tok), seed=3).to(torch.bfloat16)
    folder = tmp_path / "source"
    model.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text('{"from": "the user\'s folder"}')
    return folder, tok, model


def snapshot(folder):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()}


def test_folder_is_linked_not_copied_and_tokenizer_is_the_agents(hf_folder, tmp_path):
    folder, tok, model = hf_folder
    before = snapshot(folder)
    init = engine_model_dir(folder, tok, tmp_path / "engines" / "init")
    weights = init / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (folder / "model.safetensors").resolve()
    assert (init / "config.json").is_symlink()
    # the agent's tokenizer is a real file here; the user's tokenizer_config.json is neither linked nor touched
    assert not (init / "tokenizer_config.json").is_symlink()
    assert "the user's folder" not in (init / "tokenizer_config.json").read_text()
    assert snapshot(folder) == before
    # the stored dtype is what the engine reads: bf16 stays bf16
    assert model_hf_config(init).to_dict().get("torch_dtype", model_hf_config(init).to_dict().get("dtype")) in (
        "bfloat16", torch.bfloat16)
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_rerun_replaces_an_earlier_folder(hf_folder, tmp_path):
    folder, tok, model = hf_folder
    init = tmp_path / "init"
    init.mkdir()
    (init / "model.safetensors").write_bytes(b"stale fp32 copy of an earlier run")
    (init / "stale.bin").write_bytes(b"x")
    engine_model_dir(folder, tok, init)
    assert (init / "model.safetensors").is_symlink() and not (init / "stale.bin").exists()


def test_in_memory_model_is_saved(hf_folder, tmp_path):
    _, tok, model = hf_folder
    init = engine_model_dir(model, tok, tmp_path / "init")
    assert (init / "model.safetensors").is_file() and not (init / "model.safetensors").is_symlink()
    assert (init / "tokenizer_config.json").is_file()


def test_not_an_hf_folder_is_refused_by_name(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty.*no config.json"):
        engine_model_dir(tmp_path / "empty", None, tmp_path / "init")


@pytest.mark.parametrize(("backend", "engine", "hf_path", "expected"), [
    ("megatron", "sglang", "folder", True),
    ("megatron", "vllm", "folder", True),
    ("megatron", "sglang", None, False),  # a seeded random init: the controller builds it
    ("megatron", "hf", "folder", False),  # the in-process HF engine samples from the model here
    ("hf", "sglang", "folder", False),  # the HF backend trains the model in this process
])
def test_which_agents_the_controller_never_loads(tmp_path, hf_folder, backend, engine, hf_path, expected):
    folder, _, _ = hf_folder
    exp = tiny_exp(tmp_path, backend=backend)
    agent = exp.agents[0]
    if hf_path:
        agent = dataclasses.replace(agent, model=dataclasses.replace(agent.model, hf_path=str(folder)))
    exp = dataclasses.replace(exp, rollout=dataclasses.replace(exp.rollout, engine=engine))
    assert reads_weights_itself(exp, agent) is expected


def test_gguf_file_is_loaded_by_the_controller(tmp_path, hf_folder):
    folder, _, _ = hf_folder
    exp = tiny_exp(tmp_path, backend="megatron")
    agent = exp.agents[0]
    agent = dataclasses.replace(agent, model=dataclasses.replace(agent.model, hf_path=str(folder), gguf_file="m.gguf"))
    exp = dataclasses.replace(exp, rollout=dataclasses.replace(exp.rollout, engine="sglang"))
    assert reads_weights_itself(exp, agent) is False
    assert os.path.isdir(folder)


def test_planned_nodes_from_job_wide_gpu_ids(monkeypatch):
    from hacrl_megatron.rollout.engine_actor import planned_nodes

    monkeypatch.delenv("HACRL_GPUS_PER_NODE", raising=False)
    assert planned_nodes([[8, 9], [10, 11]], "a") == [None, None]  # no job layout: Ray places them
    monkeypatch.setenv("HACRL_GPUS_PER_NODE", "8")
    assert planned_nodes([[8, 9], [20, 21], [0]], "a") == [1, 2, 0]
    assert planned_nodes([None], "a") == [None]
    with pytest.raises(ValueError, match=r"agent 'a': rollout_gpu_ids \[6, 7, 8, 9\] span nodes at 8 GPUs per node"):
        planned_nodes([[6, 7, 8, 9]], "a")
    monkeypatch.setenv("HACRL_GPUS_PER_NODE", "eight")
    with pytest.raises(ValueError, match=r"\$HACRL_GPUS_PER_NODE='eight': must be a positive GPU count"):
        planned_nodes([[0]], "a")


def test_starting_folder_without_config_is_refused_naming_the_agent(tmp_path):
    from hacrl_megatron.trainer.runtime import starting_weights_dir

    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"damaged")
    exp = tiny_exp(tmp_path, backend="megatron")
    agent = dataclasses.replace(exp.agents[0], model=dataclasses.replace(exp.agents[0].model,
                                                                         hf_path=str(tmp_path / "weights")))
    with pytest.raises(FileNotFoundError, match=r"agent 'llama': model directory .*weights' has no config.json"):
        starting_weights_dir(agent)
