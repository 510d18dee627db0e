"""``agents.N.model.dtype``: ``auto`` follows the starting checkpoint's dtype (models/dtype.py) where the
trainer computes on CUDA, float32 on the CPU path, for a model built from sizes and for the HF backend;
an explicit value always wins; anything else is refused naming the field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hacrl_megatron.cli import main
from hacrl_megatron.config import ConfigError, load_config
from hacrl_megatron.models.dtype import checkpoint_dtype, resolve_model_dtype
from hacrl_megatron.models.resolved import resolve_agent
from tests.distributed.megatron_helpers import tiny_hf_config
from tests.e2e.test_trainer import tiny_exp

VOCAB = 128


def hf_dir(tmp_path, stored: str, key: str = "dtype"):
    """A tiny Llama HF folder whose config.json says its weights are ``stored`` (under ``key``)."""
    folder = tmp_path / f"llama-{stored}-{key}"
    tiny_hf_config("llama", vocab=VOCAB).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None)
    config[key] = stored
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def agent_on(tmp_path, folder, dtype: str = "auto", backend: str = "megatron"):
    cfg = tiny_exp(tmp_path, backend=backend).agents[0]
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=str(folder), dtype=dtype))


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])  # transformers 5's key, and older configs'
def test_auto_takes_bfloat16_from_a_bf16_checkpoint(tmp_path, key):
    agent = resolve_agent(agent_on(tmp_path, hf_dir(tmp_path, "bfloat16", key)), VOCAB, cuda=True)
    assert agent.dtype == agent.cfg.model.dtype == agent.spec.dtype == "bfloat16"
    assert agent.checkpoint_dtype == "bfloat16"


def test_auto_takes_float32_from_a_float32_checkpoint(tmp_path):
    agent = resolve_agent(agent_on(tmp_path, hf_dir(tmp_path, "float32")), VOCAB, cuda=True)
    assert agent.dtype == agent.spec.dtype == "float32"


def test_an_explicit_dtype_wins(tmp_path):
    bf16 = hf_dir(tmp_path, "bfloat16")
    for dtype in ("float32", "float16"):
        agent = resolve_agent(agent_on(tmp_path, bf16, dtype=dtype), VOCAB, cuda=True)
        assert agent.dtype == agent.spec.dtype == dtype
    assert resolve_agent(agent_on(tmp_path, hf_dir(tmp_path, "float32"), dtype="bfloat16"), VOCAB, cuda=False).dtype \
        == "bfloat16"


def test_auto_is_float32_on_cpu_for_sizes_the_hf_backend_and_the_hf_engine(tmp_path):
    bf16 = hf_dir(tmp_path, "bfloat16")
    assert resolve_agent(agent_on(tmp_path, bf16), VOCAB, cuda=False).dtype == "float32"  # the CPU path
    # the in-process engine samples from the float32 model this process loads: the trainer matches it
    assert resolve_agent(agent_on(tmp_path, bf16), VOCAB, engine="hf", cuda=True).dtype == "float32"
    assert resolve_agent(agent_on(tmp_path, bf16), VOCAB, engine="sglang", cuda=True).dtype == "bfloat16"
    hf = resolve_agent(agent_on(tmp_path, bf16, backend="hf"), VOCAB, cuda=True)
    assert hf.dtype == "float32" and hf.spec is None  # the HF backend trains the float32 model it loads
    sized = resolve_agent(tiny_exp(tmp_path, backend="megatron").agents[0], VOCAB, cuda=True)
    assert sized.weights is None and sized.dtype == sized.spec.dtype == "float32"
    assert resolve_model_dtype("auto", None, cuda=True) == "float32"


def test_checkpoint_dtype_reads_names_and_torch_dtypes():
    import torch

    assert checkpoint_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert checkpoint_dtype({"dtype": torch.float16}) == "float16"
    assert checkpoint_dtype({"dtype": "int8"}) is None and checkpoint_dtype({}) is None


def test_a_bad_dtype_is_refused_naming_the_field(capsys):
    with pytest.raises(ConfigError, match=r"^agents\.1\.model\.dtype='fp8': must be one of "
                                          r"\['auto', 'float32', 'bfloat16', 'float16'\]$"):
        load_config("cpu_demo", ["agents.1.model.dtype=fp8"])
    assert main(["config", "agents.0.model.dtype=half"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "agents.0.model.dtype='half'" in err[0]


def test_the_planner_plans_auto_in_the_checkpoints_dtype():
    from hacrl_megatron.plan.experiment import agent_spec

    for dtype, expected in (("auto", "bfloat16"), ("float32", "float32")):
        cfg = load_config("paper_qwen3_4b_with_instruct", [f"agents.0.model.dtype={dtype}"]).agents[0]
        assert agent_spec(cfg)[0].dtype == expected  # the built-in config of Qwen3-4B says bfloat16


@pytest.mark.parametrize("cuda", [True, False])
def test_hacrl_config_shows_what_auto_resolves_to(tmp_path, capsys, monkeypatch, cuda):
    import torch
    import yaml

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    folder = hf_dir(tmp_path, "bfloat16")
    assert main(["config", f"output_dir={tmp_path / 'run'}", f"agents.0.model.hf_path={folder}",
                 "agents.1.model.dtype=float16", "rollout.engine=sglang"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["agents"][0]["model"]["dtype"] == "auto"  # the printed config loads as it is
    first = ("bfloat16  (auto: the starting checkpoint stores bfloat16)" if cuda else
             "float32  (auto: float32 without CUDA, the CPU path; the checkpoint stores bfloat16)")
    assert out.splitlines()[-3:] == [f"# resolved on this machine ({'CUDA' if cuda else 'no CUDA'}):",
                                     f"#   agents.0.model.dtype: {first}",
                                     "#   agents.1.model.dtype: float16  (set in the config)"]
