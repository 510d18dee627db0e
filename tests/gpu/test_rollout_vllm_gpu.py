"""A real vLLM server on a GPU with every weight transport: disk, tensor (vLLM's CUDA IPC receiver) and
distributed (vLLM's NCCL receiver, joined by a unique id from ``torch.cuda.nccl``), plus sleep / wake-up.

Skipped without CUDA or without vLLM (``$HACRL_VLLM_PYTHON``, ``.venv-vllm``, or this Python with the
CUDA ``vllm`` wheel); the distributed case needs two GPUs (NCCL puts two ranks of one group on two
devices). What only this test can confirm: vLLM's receivers accept our init and update payloads, the
chunks cut by ``sync/vllm_nccl.packed_chunks`` land as vLLM's packed consumer reads them, and the
pickled UUID-keyed IPC handles rebuild on the server. Each case pushes weights that differ from the
server's folder and holds the server's log-prob of a sequence to the trainer's (the post-sync check).

    HACRL_VLLM_PYTHON=/opt/vllm/bin/python pytest -m gpu tests/gpu/test_rollout_vllm_gpu.py -s
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time

import pytest
import torch

from hacrl_megatron.config import VLLMConfig
from hacrl_megatron.rollout import EnginePool, SamplingParams
from hacrl_megatron.rollout.hf_engine import hf_sequence_logprob
from hacrl_megatron.rollout.vllm_engine import VLLMEngine
from hacrl_megatron.rollout.vllm_server import VLLMServer, server_env, server_flags
from hacrl_megatron.sync.disk import DiskTransport
from hacrl_megatron.sync.vllm_ipc import VLLMIPCTransport
from hacrl_megatron.sync.vllm_nccl import VLLMNCCLTransport
from tests.fixtures.vllm_env import find_vllm_python, write_tiny_llama


def _vllm_python() -> str | None:
    python, _ = find_vllm_python()
    if python is None and importlib.util.find_spec("vllm") is not None:
        python = sys.executable
    if python is not None and torch.cuda.is_available():
        probe = subprocess.run([python, "-c", "import torch; assert torch.cuda.is_available()"], capture_output=True)
        return python if probe.returncode == 0 else None
    return python


VLLM_PYTHON = _vllm_python() if torch.cuda.is_available() else None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(VLLM_PYTHON is None, reason="needs vLLM with CUDA (pip install vllm, or HACRL_VLLM_PYTHON)"),
]
PROMPT, RESPONSE = [5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hacrl_megatron.exchange import load_tokenizer

    path = tmp_path_factory.mktemp("tiny_llama_gpu")
    tok = load_tokenizer("char", tmp_path_factory.mktemp("tok"))
    write_tiny_llama(path, tok)
    return path, tok


def serve(model_dir, log, *, weight_sync: str, colocate: bool = False, gpu: int = 0) -> VLLMServer:
    v = VLLMConfig(gpu_memory_utilization=0.25, max_model_len=128, python=VLLM_PYTHON)
    # the server inherits this process's NCCL_* variables: vLLM builds the communicators it shares with the
    # trainer under them (vllm/utils/nccl.py: unpinned_nccl_env), and peers with different ones hang
    env = server_env(v, weight_sync=weight_sync)
    server = VLLMServer(model_dir, gpu_ids=[gpu], flags=server_flags(v, colocate=colocate, weight_sync=weight_sync),
                        env=env, log_path=log, python=VLLM_PYTHON)
    t0 = time.perf_counter()
    server.start(timeout=900)
    print(f"\nvLLM GPU server ({weight_sync}) healthy after {time.perf_counter() - t0:.1f} s")
    return server


def trained_copy(path) -> torch.nn.Module:
    """The folder's model with every weight moved: what a training step would push."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def check_pushed(pool: EnginePool, model: torch.nn.Module, transport_name: str) -> None:
    before = pool.sequence_logprob(PROMPT, RESPONSE)
    t0 = time.perf_counter()
    count = pool.load_weights((n, t) for n, t in model.state_dict().items())
    seconds = time.perf_counter() - t0
    engine, trainer = pool.sequence_logprob(PROMPT, RESPONSE), hf_sequence_logprob(model, PROMPT, RESPONSE)
    print(f"vLLM {transport_name}: {count} tensors in {seconds:.2f} s; score {before:.4f} -> {engine:.4f} "
          f"(trainer {trainer:.4f}, |diff| {abs(engine - trainer):.2e})")
    assert abs(engine - before) > 1e-2 and abs(engine - trainer) < 1e-3 * len(RESPONSE)


def test_disk_generation_and_sleep(model_dir, tmp_path):
    path, tok = model_dir
    server = serve(path, tmp_path / "disk.log", weight_sync="disk", colocate=True)
    try:
        engine = VLLMEngine(server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=server)
        pool = EnginePool([engine], DiskTransport(tmp_path / "sync", path), colocate=True, name="a")
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=1)
        out = pool.generate([PROMPT, PROMPT[:3]], params)
        assert len({c.token_ids for g in out for c in g}) == 8 and pool.generate([PROMPT, PROMPT[:3]], params) == out
        free = torch.cuda.mem_get_info(0)[0]
        pool.release_memory()  # sleep level 1: weights to host memory, KV cache dropped
        assert torch.cuda.mem_get_info(0)[0] > free
        check_pushed(pool, trained_copy(path), "disk")  # the pool wakes the server up for the sync
    finally:
        server.stop()


def test_tensor_transport_is_vllms_ipc_receiver(model_dir, tmp_path):
    path, tok = model_dir
    server = serve(path, tmp_path / "ipc.log", weight_sync="tensor", colocate=True)
    try:
        engine = VLLMEngine(server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=server)
        pool = EnginePool([engine], VLLMIPCTransport(bucket_bytes=64 << 10), colocate=True, name="a")
        model = trained_copy(path)
        check_pushed(pool, model, "tensor (CUDA IPC)")
        assert engine.server_weight_version() == "1"
        check_pushed(pool, trained_copy(path), "tensor (CUDA IPC), second push")
    finally:
        server.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the trainer and the server on two GPUs")
def test_distributed_transport_is_vllms_nccl_receiver(model_dir, tmp_path):
    path, tok = model_dir
    server = serve(path, tmp_path / "nccl.log", weight_sync="distributed", gpu=1)
    transport = VLLMNCCLTransport(bucket_bytes=64 << 10)  # several chunks for the tiny model
    try:
        torch.cuda.set_device(0)
        engine = VLLMEngine(server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=server)
        pool = EnginePool([engine], transport, name="a")
        check_pushed(pool, trained_copy(path), "distributed (NCCL)")
        assert transport.chunks_sent > 1 and engine.server_weight_version() == "1"
        check_pushed(pool, trained_copy(path), "distributed (NCCL), second push, same group")
    finally:
        transport.close()
        server.stop()
