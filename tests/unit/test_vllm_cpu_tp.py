"""rollout.vllm.tp > 1 on CPU: each rank of each agent's server gets its own core (vLLM asserts one core
list per rank), or ``hacrl config`` refuses the run where the machine has too few cores."""

from __future__ import annotations

import sys

import pytest

from hacrl_megatron.config import ConfigError, VLLMConfig, load_config
from hacrl_megatron.rollout import vllm_server


def test_each_rank_of_each_server_is_bound_to_its_own_core(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(vllm_server.os, "cpu_count", lambda: 8)
    binds = [vllm_server.server_env(VLLMConfig(tp=2), weight_sync="disk", cpu_core=k)["VLLM_CPU_OMP_THREADS_BIND"]
             for k in range(2)]
    assert binds == ["0|1", "2|3"]  # agent 0's ranks, agent 1's ranks: one list per rank, no core shared
    assert vllm_server.server_env(VLLMConfig(), weight_sync="disk", cpu_core=1)["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def vllm_demo(tp: int):
    return load_config("cpu_demo", ["rollout.engine=vllm", f"rollout.vllm.python={sys.executable}",
                                    "agents.1.model.hidden_size=128", f"rollout.vllm.tp={tp}"])


def test_hacrl_config_refuses_more_cpu_ranks_than_cores(monkeypatch):
    monkeypatch.setattr("hacrl_megatron.config.validation.os.cpu_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.tp.*4 server ranks.*this machine has 2"):
        vllm_demo(tp=2)
    assert vllm_demo(tp=1).rollout.vllm.tp == 1
    monkeypatch.setattr("hacrl_megatron.config.validation.os.cpu_count", lambda: 4)
    assert vllm_demo(tp=2).rollout.vllm.tp == 2
