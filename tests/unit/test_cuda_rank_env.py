"""Megatron ranks on CUDA start with CUDA_DEVICE_MAX_CONNECTIONS=1 on every path, and an MoE model's
grouped-GEMM setting is one value for its layer spec and its TransformerConfig.

Paths: ``init_parallel`` with NCCL (in-process and spawned local ranks) sets it before the rank's CUDA
context exists; Ray workers on GPU bundles get it in their runtime environment; NeMo-Run executors
(local, Docker; Slurm's script exports it itself) in their job environment. A value the user exported
wins everywhere. No GPU here: CUDA is stubbed where the path needs it.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from hacrl_megatron.models import parallel
from hacrl_megatron.models.parallel import CUDA_RANK_ENV, cuda_rank_env, export_cuda_rank_env

KEY = "CUDA_DEVICE_MAX_CONNECTIONS"


def test_defaults_keep_what_the_user_set():
    assert CUDA_RANK_ENV == {KEY: "1"}
    assert cuda_rank_env({}) == {KEY: "1"}
    assert cuda_rank_env({KEY: "8"}) == {KEY: "8"}


def test_export_sets_it_once_and_warns_when_cuda_is_already_up(monkeypatch, caplog):
    monkeypatch.delenv(KEY, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    export_cuda_rank_env()
    assert os.environ[KEY] == "1" and not caplog.records
    monkeypatch.setenv(KEY, "4")
    export_cuda_rank_env()
    assert os.environ[KEY] == "4"  # the user's value stays
    monkeypatch.delenv(KEY)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger=parallel.__name__):
        export_cuda_rank_env()
    assert os.environ[KEY] == "1" and "after this process initialised CUDA" in caplog.text


class _Stop(Exception):
    pass


def test_init_parallel_with_nccl_sets_it_before_the_cuda_context(monkeypatch):
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    seen = []
    monkeypatch.delenv(KEY, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel, "enable_cpu_compat", lambda: None)

    def set_device(index):  # the first CUDA call of a rank: the variable must already be there
        seen.append(os.environ.get(KEY))
        raise _Stop

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(_Stop):
        parallel.init_parallel(1, 1, 1, backend="nccl")
    assert seen == ["1"]


def _recording_actor() -> type:
    """A stand-in Ray actor class that records the ``options`` spawn_actors gives each rank."""

    class Actor:
        options_seen: list[dict] = []

        @classmethod
        def options(cls, **kw):
            cls.options_seen.append(kw)
            return cls

        @classmethod
        def remote(cls, *args):
            return args

    return Actor


def test_ray_workers_on_gpu_bundles_get_it(monkeypatch):
    pytest.importorskip("ray")
    from hacrl_megatron.agents.ray_placement import spawn_actors

    Actor = _recording_actor()
    monkeypatch.delenv(KEY, raising=False)
    spawn_actors(Actor, object(), {"CPU": 1.0, "GPU": 1.0}, 2, {"NCCL_DEBUG": "WARN"}, "a")
    envs = [o["runtime_env"]["env_vars"] for o in Actor.options_seen]
    assert len(envs) == 2 and all(e[KEY] == "1" and e["NCCL_DEBUG"] == "WARN" for e in envs)
    Actor.options_seen.clear()
    spawn_actors(Actor, object(), {"CPU": 1.0, "GPU": 1.0}, 1, {KEY: "2"}, "a")  # the job's own value wins
    assert Actor.options_seen[0]["runtime_env"]["env_vars"][KEY] == "2"
    Actor.options_seen.clear()
    spawn_actors(Actor, object(), {"CPU": 1.0}, 1, {}, "a")  # CPU ranks: not a CUDA setting
    assert KEY not in Actor.options_seen[0]["runtime_env"]["env_vars"]


def test_ray_workers_start_from_an_interpreter_under_a_spaced_folder(monkeypatch):
    """Ray splices ``py_executable`` unquoted into ``bash -c "exec ..."``: a venv path with a space
    goes there quoted, a space-free one is left to Ray."""
    pytest.importorskip("ray")
    import sys

    from hacrl_megatron.agents.ray_placement import spawn_actors

    Actor = _recording_actor()
    monkeypatch.setattr(sys, "executable", "/opt/my envs/a/bin/python")
    spawn_actors(Actor, object(), {"CPU": 1.0}, 1, {}, "a")
    assert Actor.options_seen[-1]["runtime_env"]["py_executable"] == "'/opt/my envs/a/bin/python'"
    monkeypatch.setattr(sys, "executable", "/opt/envs/a/bin/python")
    spawn_actors(Actor, object(), {"CPU": 1.0}, 1, {}, "a")
    assert "py_executable" not in Actor.options_seen[-1]["runtime_env"]


# --------------------------------------------------------------------------------------------
# MoE grouped GEMM: one value for the spec and the config


def test_grouped_gemm_is_one_value_for_spec_and_config(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core.models import gpt
    from megatron.core.models.gpt import gpt_layer_specs

    from hacrl_megatron.models import provider
    from hacrl_megatron.models.parallel import init_parallel
    from tests.distributed.moe_helpers import tiny_moe_config

    spec = provider.arch_from_hf(tiny_moe_config("qwen3_moe"))
    dense = provider.ArchSpec(**{**spec.__dict__, "num_experts": 0, "moe_topk": 0, "moe_ffn_hidden_size": 0})
    assert provider.moe_grouped_gemm(spec, True) and not provider.moe_grouped_gemm(spec, False)
    assert not provider.moe_grouped_gemm(dense, True)
    built = {}
    monkeypatch.setattr(gpt, "GPTModel", lambda config, transformer_layer_spec, **kw: built.update(config=config))
    local = gpt_layer_specs.get_gpt_layer_local_spec

    def te_spec(num_experts, moe_grouped_gemm, qk_layernorm):  # TE is not installed here: record the request
        built["te_grouped"] = moe_grouped_gemm
        return local(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm)

    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", te_spec)
    init_parallel(1, 1, 1)
    provider.build_gpt_model(spec, te=True)
    assert built["te_grouped"] is True and built["config"].moe_grouped_gemm is True
    provider.build_gpt_model(spec, te=False)
    assert built["config"].moe_grouped_gemm is False  # the local spec's SequentialMLP experts
    assert provider.transformer_config(spec, grouped_gemm=True).moe_grouped_gemm is True
    assert provider.transformer_config(spec).moe_grouped_gemm is provider.use_transformer_engine()
