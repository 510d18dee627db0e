"""A Ray agent on a GPU pushes its weights into a real SGLang server from its own rank 0 (GPU + sglang + ray).

The CPU test (tests/distributed/test_ray_weight_push.py) checks the same path bit for bit against
stand-in servers over gloo. What only this test can confirm: SGLang's real rendezvous accepts a
group whose rank 0 is a Ray actor (master address on the actor's node), NCCL (2 GPUs: the actor on
GPU 0, the server on GPU 1) or gloo from GPU tensors (1 GPU, shared), and the pushed buckets load
into the real model: a server given broken weights by this process generates and scores as before
once the agent's ranks pushed. Run on a GPU node with ``pytest -m gpu tests/gpu/test_ray_weight_push_gpu.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.gpu.test_rollout_sglang_gpu import _setup
from tests.gpu.test_rollout_sglang_gpu import pytestmark as SGLANG_GPU_MARKS

pytestmark = [
    *SGLANG_GPU_MARKS,  # a GPU, sglang and the SmolLM2 weights, as the rollout GPU tests
    pytest.mark.skipif(importlib.util.find_spec("ray") is None or importlib.util.find_spec("megatron") is None,
                       reason="needs ray and megatron-core"),
]


@pytest.mark.parametrize("mode", ["gloo", "nccl"])
def test_ray_agent_rank0_pushes_into_a_real_sglang_server(tmp_path, mode):
    import ray
    from transformers import AutoModelForCausalLM

    from hacrl_megatron.agents.batch import SequenceBatch
    from hacrl_megatron.agents.ray_agent import RayAgent
    from hacrl_megatron.rollout import EnginePool, SamplingParams, SGLangEngine
    from hacrl_megatron.sync import sync_weights
    from hacrl_megatron.sync.distributed import DistributedTransport
    from tests.distributed.megatron_helpers import agent_config, train_config

    if mode == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs trainer rank 0 and the server on different GPUs: needs 2 GPUs")
    gpu = 1 if mode == "nccl" else 0
    folder, tok, prompts, server = _setup(tmp_path, gpu=gpu)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    greedy_params = SamplingParams(temperature=0, max_new_tokens=32)
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False)  # the agent's rank: GPU 0
    agent = None
    try:
        agent = RayAgent.from_hf_model(agent_config("llama", str(folder), name="g"), hf, train_cfg=train_config(),
                                       use_gpu=True)
        with server:
            engine = SGLangEngine(server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=server)
            pool = EnginePool([engine], DistributedTransport(64 << 20, backend=mode, group_name="gpu_ray"), name="g")
            try:
                greedy = pool.generate(prompts, greedy_params)
                device = "cuda:0" if mode == "nccl" else "cpu"  # this process sends the broken weights
                broken = {k: (torch.zeros_like(v) if "mlp.down_proj" in k else v).to(device, torch.bfloat16)
                          for k, v in hf.state_dict().items()}
                pool.load_weights(broken.items())
                assert pool.generate(prompts, greedy_params) != greedy
                pool.transport.close()  # from now on the agent's ranks send (trainer/runtime.py's transport)
                pool.transport = DistributedTransport(64 << 20, backend=mode, group_name="gpu_ray", ranks=agent)
                assert sync_weights(agent, pool) == len(hf.state_dict())  # rank 0 of the agent sends
                assert pool.generate(prompts, greedy_params) == greedy
                prompt, response = prompts[0], list(greedy[0][0].token_ids[:16])
                batch = SequenceBatch(input_ids=(torch.tensor(prompt + response),), prompt_lens=torch.tensor([len(prompt)]))
                trainer_sum = float(agent.sequence_logprobs(batch)[0][0])
                assert pool.sequence_logprob(prompt, response) == pytest.approx(trainer_sum, abs=0.05 * len(response))
            finally:
                pool.close()
    finally:
        if agent is not None:
            agent.close()
        ray.shutdown()


def test_a_pp2_ray_agent_pushes_from_both_stages_into_a_real_sglang_server(tmp_path):
    """sync/stages.py against the real server: one weight group per pipeline stage (SGLang keeps them by
    name), each formed inside the server's weight-update session, buckets from both groups in turns, and
    the server assembling the model from them. The agent's two ranks run on CPU (gloo), the server on GPU 0."""
    import ray
    from transformers import AutoModelForCausalLM

    from hacrl_megatron.agents.ray_agent import RayAgent
    from hacrl_megatron.rollout import EnginePool, SamplingParams, SGLangEngine
    from hacrl_megatron.sync import sync_weights
    from hacrl_megatron.sync.distributed import DistributedTransport
    from hacrl_megatron.sync.stages import StageTransport
    from tests.distributed.megatron_helpers import agent_config, train_config

    folder, tok, prompts, server = _setup(tmp_path, gpu=0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    greedy_params = SamplingParams(temperature=0, max_new_tokens=32)
    ray.init(num_cpus=4, include_dashboard=False)
    agent = None
    try:
        agent = RayAgent.from_hf_model(agent_config("llama", str(folder), pp=2, name="s"), hf,
                                       train_cfg=train_config(), use_gpu=False)
        with server:
            engine = SGLangEngine(server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=server)
            pool = EnginePool([engine], DistributedTransport(64 << 20, backend="gloo", group_name="gpu_st"), name="s")
            try:
                greedy = pool.generate(prompts, greedy_params)
                broken = {k: (torch.zeros_like(v) if "mlp.down_proj" in k else v).to(torch.bfloat16)
                          for k, v in hf.state_dict().items()}
                pool.load_weights(broken.items())
                assert pool.generate(prompts, greedy_params) != greedy
                pool.transport.close()
                pool.transport = StageTransport(16 << 20, backend="gloo", group_name="gpu_st", ranks=agent)
                assert sync_weights(agent, pool) == len(hf.state_dict())  # each stage sends its own layers
                assert [o.part for o in agent.push_outcomes] == ["stage0", "stage1"]
                assert all(o.bytes_sent > 0 for o in agent.push_outcomes)
                assert pool.generate(prompts, greedy_params) == greedy
            finally:
                pool.close()
    finally:
        if agent is not None:
            agent.close()
        ray.shutdown()
