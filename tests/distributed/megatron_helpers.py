"""Shared fixtures for the Megatron model/agent tests: tiny HF models, HF references, 2-rank worlds.

Tiny models (hidden 32, 2 layers, 4 heads, 2 KV heads, vocab 97) are saved with ``save_pretrained``
so the tests exercise the safetensors reader. The vocabulary 97 is odd on purpose: at TP = 2 it
forces Megatron vocab padding (98 rows), which the converter and the log-prob code must hide.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

VOCAB = 97
ARCHS = ("llama", "qwen2", "qwen3")


def tiny_hf_config(arch: str, vocab: int = VOCAB, layers: int = 2, tie: bool | None = None) -> Any:
    import transformers

    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[arch]
    kw: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=5000.0,
        tie_word_embeddings=(arch != "qwen2") if tie is None else tie,
    )
    if arch == "qwen3":
        kw["head_dim"] = 8
    cfg = getattr(transformers, cls)(**kw)
    cfg.architectures = [cls.replace("Config", "ForCausalLM")]
    return cfg


def make_tiny_hf(arch: str, out_dir: str, seed: int = 0, **cfg_kw: Any) -> Any:
    """A random tiny HF model (norm weights and biases perturbed so that every tensor matters), saved."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(arch, **cfg_kw), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(out_dir)
    return model.eval()


def sample_batch(seed: int = 1, lens: tuple[int, ...] = (7, 5, 9, 6), prompts: tuple[int, ...] = (3, 2, 4, 1)) -> Any:
    from hacrl_megatron.agents.batch import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    ids = tuple(torch.randint(0, VOCAB, (n,), generator=g) for n in lens)
    return SequenceBatch(input_ids=ids, prompt_lens=torch.tensor(prompts),
                         loss_inputs=weights(torch.linspace(0.5, 1.5, len(lens))))


def weights(w: torch.Tensor) -> Any:
    """LossInputs that carry per-sequence weights ``w`` [S] (as advantages) for :func:`sft_loss`."""
    from hacrl_megatron.algo import LossInputs

    s = len(w)
    return LossInputs(advantages=w, is_self=torch.ones(s, dtype=torch.bool), discrepancy=torch.ones(s),
                      source_logp_sum=torch.zeros(s), source_len=torch.ones(s, dtype=torch.long))


def hf_token_logprobs(model: Any, batch: Any, temperature: float = 1.0) -> list[torch.Tensor]:
    """Per sequence, log π of each response token under an HF model (the reference)."""
    out = []
    for ids, p in zip(batch.input_ids, batch.prompt_lens.tolist()):
        logits = model(ids.unsqueeze(0)).logits[0].float() / temperature
        out.append(torch.log_softmax(logits, -1)[p - 1 : -1].gather(1, ids[p:].unsqueeze(1))[:, 0])
    return out


def hf_seq_logprobs(model: Any, batch: Any, temperature: float = 1.0) -> torch.Tensor:
    """[S] Σ log π of the response tokens under an HF model (the reference)."""
    return torch.stack([t.sum() for t in hf_token_logprobs(model, batch, temperature)])


def sft_loss(lp: Any, inputs: Any, info: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted per-token-mean NLL (weights: ``inputs.advantages``), normalised by the global
    sequence count of the mini-batch (a LossFn)."""
    per_seq = lp.seq_logp_sum / lp.seq_len.to(lp.seq_logp_sum.dtype)
    loss = -(inputs.advantages * per_seq).sum() / info.num_sequences
    return loss, {"mean_logp": float(per_seq.mean()), "m": float(info.update_index)}


def hf_reference_step(model: Any, batch: Any, lr: float, grad_clip: float = 1.0) -> tuple[dict[str, torch.Tensor], float]:
    """One AdamW step of ``sft_loss`` on an HF model: (new state dict, pre-clip grad norm)."""
    model.zero_grad()
    per_seq = hf_seq_logprobs(model, batch) / batch.response_lens.float()
    loss = -(batch.loss_inputs.advantages * per_seq).sum() / len(batch)
    loss.backward()
    # megatron counts a tied embedding once; so does parameters() (lm_head is the same tensor)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, float(norm)


def model_logits(agent: Any, output: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [B, T, V] from a LocalAgent's last-stage model output (all TP ranks)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if agent.head.impl != "megatron":  # the model returns hidden states; apply this rank's LM-head shard
        output = output @ agent.head.weight().t()
    return gather_from_tensor_model_parallel_region(output)[..., : agent.spec.vocab_size]


def agent_config(arch: str, hf_dir: str | None = None, tp: int = 1, pp: int = 1, dp: int = 1,
                 lr: float = 1e-3, dist_opt: bool = False, name: str = "a") -> Any:
    from hacrl_megatron.config import AgentConfig, ModelConfig, ParallelConfig

    return AgentConfig(name=name, model=ModelConfig(arch=arch, hf_path=hf_dir), lr=lr,
                       parallel=ParallelConfig(tp=tp, pp=pp, dp=dp, use_distributed_optimizer=dist_opt))


def train_config(micro_batch_size: int = 2, **kw: Any) -> Any:
    from hacrl_megatron.config import TrainConfig

    return TrainConfig(micro_batch_size=micro_batch_size, **kw)


# --------------------------------------------------------------------------------------------
# 2-process gloo worlds


def _worker(rank: int, world: int, init_file: str, fn: Callable[..., dict], args: tuple, out_path: str) -> None:
    from hacrl_megatron.models.parallel import local_world_env, shutdown_parallel

    os.environ.update(local_world_env(rank, world, init_file), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    result = fn(rank, *args)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    shutdown_parallel()


def run_world(fn: Callable[..., dict], world: int, args: tuple, tmp_dir: str) -> dict:
    """Run ``fn(rank, *args)`` in ``world`` spawned gloo processes; return rank 0's JSON result. A failure
    is reported as the first rank's to fail (``spawn_local_world``)."""
    from hacrl_megatron.models.parallel import spawn_local_world

    out_path = os.path.join(tmp_dir, f"result_{fn.__name__}.json")
    spawn_local_world(_worker, world, (fn, args, out_path))
    with open(out_path) as f:
        return json.load(f)


def start_local_ray() -> None:
    """A private 4-CPU Ray cluster for the Ray-agent tests, one intra-op thread per process.

    No idle worker pool: every rank actor gets its own process anyway (runtime_env), and on two
    cores prestarting idle workers only slows the start."""
    import ray

    from hacrl_megatron.sockets import ray_temp_dir

    torch.set_num_threads(1)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=ray_temp_dir(),
             _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False})


def hacpo_batch(seed: int = 3, lens: tuple[int, ...] = (7, 5, 19, 6, 12, 4, 9, 15),
                prompts: tuple[int, ...] = (3, 2, 4, 1, 5, 2, 3, 6)) -> Any:
    """A length-skewed batch of self and cross sequences with HACPO's loss inputs: two sources, signed
    advantages, and source log-prob sums near the responses' typical values (so some cross ratios fall
    inside the window and some are clipped)."""
    from hacrl_megatron.agents.batch import SequenceBatch
    from hacrl_megatron.algo import LossInputs

    g = torch.Generator().manual_seed(seed)
    ids = tuple(torch.randint(0, VOCAB, (n,), generator=g) for n in lens)
    s = len(lens)
    is_self = torch.arange(s) % 2 == 0
    response = torch.tensor(lens) - torch.tensor(prompts)
    inputs = LossInputs(
        advantages=torch.linspace(-1.0, 1.0, s), is_self=is_self, discrepancy=torch.where(is_self, 1.0, 0.8),
        source_logp_sum=-4.6 * response.float() + torch.randn(s, generator=g),
        source_len=response + (~is_self).long(), source_index=(~is_self).long(),
    )
    return SequenceBatch(input_ids=ids, prompt_lens=torch.tensor(prompts), loss_inputs=inputs)


def hacpo_loss() -> Any:
    """HACPO's loss (the paper's defaults) for two agents, as a LossFn."""
    from hacrl_megatron.algo import build_algorithm
    from hacrl_megatron.config import HACPOConfig

    return build_algorithm(HACPOConfig(), 2).loss_fn(["a", "b"])
