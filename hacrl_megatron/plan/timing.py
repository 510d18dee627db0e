"""Step-time estimate of one HACRL step: rollout, log-probs + training, weight sync.

First-order models, every constant in :class:`Assumptions` and printed with the plan:

* training: ``6·N`` FLOPs per trained token (forward + backward), ``+2·N`` with full recompute
  (one more forward), ``+2·N`` per token for the π_old log-prob pass over the same sequences, at
  a stated MFU of the trainer GPUs' dense bf16 peak, divided by ``1 − bubble`` with the 1F1B
  bubble ``(p − 1)/(m + p − 1)`` (``m`` micro-batches per DP rank and update);
* rollout: decode is memory-bandwidth bound: each step reads the engine's weights and the batch's
  KV cache from HBM at a stated fraction of peak bandwidth (or is compute bound at ``2·N`` FLOPs
  per token, whichever is slower); continuous batching keeps as many sequences decoding as the KV
  cache holds at full length, and the longest response is the floor on the number of steps;
  prefill at ``2·N`` per prompt token;
* weight sync: the bf16 HF weights once per step over the transport's link at a stated efficiency.

HACPO shares every response with every agent, so each agent samples ``G`` responses per prompt;
the resource-equivalent GSPO×2 baseline samples ``2G`` per agent (Zhang et al., arXiv 2603.02604,
Sec. 5): the saving is the difference of the two rollout times at the same layout.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hacrl_megatron.models.provider import ArchSpec
from hacrl_megatron.plan.gpus import GPU
from hacrl_megatron.plan.memory import EngineMemory, Layout


@dataclass(frozen=True)
class Assumptions:
    """Every constant behind the time estimate (printed with the plan)."""

    train_mfu: float = 0.35  # model FLOP utilisation of the trainer (dense bf16 peak)
    decode_hbm_efficiency: float = 0.5  # fraction of HBM peak a decode step reaches
    decode_mfu: float = 0.3  # compute bound of decode and prefill
    link_efficiency: float = 0.5  # achieved / peak bandwidth of weight-sync links
    disk_gbps: float = 2.0  # shared-filesystem write (and read) bandwidth for disk sync
    mean_response_fraction: float = 0.5  # mean response length / max_response_len (time only;
    # memory always uses the maximum, micro-batches are padded)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Tokens:
    """One step's sequence counts for one agent (B prompts, G samples, n agents)."""

    prompts: int  # B
    samples: int  # G per agent (HACPO)
    agents: int  # n: every learner trains on n·B·G sequences
    prompt_len: int
    max_response_len: int
    updates: int  # M mini-batches per step
    micro_batch: int

    def mean_seq(self, a: Assumptions) -> float:
        return self.prompt_len + a.mean_response_fraction * self.max_response_len

    @property
    def trained_sequences(self) -> int:
        return self.agents * self.prompts * self.samples


def train_seconds(spec: ArchSpec, layout: Layout, gpu: GPU, tok: Tokens, a: Assumptions) -> dict[str, float]:
    """Seconds of log-prob + training per step, split into compute (with the pipeline bubble),
    tensor-parallel communication and the data-parallel gradient reduction (neither overlapped:
    an upper bound), and the bubble fraction."""
    n = spec.num_parameters()
    tokens = tok.trained_sequences * tok.mean_seq(a)
    flops_per_token = 6 * n + 2 * n + (2 * n if layout.recompute == "full" else 0)
    m = max(1, tok.trained_sequences // (tok.updates * layout.dp * tok.micro_batch))
    bubble = (layout.pp - 1) / (m + layout.pp - 1)
    compute = flops_per_token * tokens / (layout.gpus * gpu.bf16_tflops * 1e12 * a.train_mfu) / (1 - bubble)
    # TP: 2 all-reduce-sized exchanges (attention and MLP outputs) per layer in each forward
    # (log-prob pass, training forward, recompute) and in backward; 2·h bytes per token each,
    # ring factor 2(t-1)/t, over NVLink; every DP replica moves its own tokens
    passes = 2 + 2 + (2 if layout.recompute == "full" else 0) + 2
    tp_bytes = tokens / layout.dp * spec.num_layers / layout.pp * passes * 2 * spec.hidden_size
    tp_bytes *= 2 * (layout.tp - 1) / layout.tp
    tp_comm = tp_bytes / (gpu.nvlink_gbps * 1e9 * a.link_efficiency)
    # DP: reduce-scatter + all-gather of the fp32 gradients once per update (ring 2(d-1)/d)
    per_gpu = n / (layout.tp * layout.pp)
    link = gpu.nvlink_gbps if layout.gpus <= 8 else gpu.network_gbps
    dp_comm = tok.updates * per_gpu * 4 * 2 * (layout.dp - 1) / layout.dp / (link * 1e9 * a.link_efficiency)
    return {"train_s": compute + tp_comm + dp_comm, "train_compute_s": compute, "tp_comm_s": tp_comm,
            "dp_comm_s": dp_comm, "pipeline_bubble": bubble}


def rollout_seconds(spec: ArchSpec, eng: EngineMemory, engines: int, gpu: GPU, sequences: int, tok: Tokens,
                    a: Assumptions) -> dict[str, float]:
    """Rollout of ``sequences`` responses over ``engines`` engines; tokens/s per engine and seconds."""
    per_engine = math.ceil(sequences / engines)
    context = tok.prompt_len + tok.max_response_len
    concurrency = max(1, min(per_engine, eng.kv_tokens // context))
    mean_response = a.mean_response_fraction * tok.max_response_len
    mean_ctx = tok.prompt_len + mean_response / 2
    read = eng.weights + concurrency * mean_ctx * eng.kv_bytes_per_token  # bytes per GPU per step
    n = spec.num_parameters()
    step_bw = read / (gpu.hbm_gbps * 1e9 * a.decode_hbm_efficiency)
    step_flops = 2 * n * concurrency / (eng.tp * gpu.bf16_tflops * 1e12 * a.decode_mfu)
    step = max(step_bw, step_flops)
    # continuous batching keeps `concurrency` sequences decoding; the longest response is the floor
    steps = max(tok.max_response_len, math.ceil(per_engine * mean_response / concurrency))
    prefill = 2 * n * per_engine * tok.prompt_len / (eng.tp * gpu.bf16_tflops * 1e12 * a.decode_mfu)
    seconds = steps * step + prefill
    return {"seconds": seconds, "decode_tokens_per_s_per_engine": concurrency / step, "concurrency": concurrency,
            "decode_steps": steps, "step_ms": step * 1e3, "bandwidth_bound": step_bw >= step_flops}


def sync_seconds(spec: ArchSpec, transport: str, gpu: GPU, a: Assumptions) -> float:
    """Weight sync of the bf16 HF weights: ``tensor`` (colocated, CUDA IPC over NVLink-gathered
    shards), ``distributed`` (NCCL broadcast to engines on other nodes), ``disk`` (write + read)."""
    nbytes = spec.num_parameters() * 2
    if transport == "tensor":
        return nbytes / (gpu.nvlink_gbps * 1e9 * a.link_efficiency)
    if transport == "distributed":
        return nbytes / (min(gpu.network_gbps, gpu.nvlink_gbps) * 1e9 * a.link_efficiency)
    if transport == "disk":
        return 2 * nbytes / (a.disk_gbps * 1e9)
    raise ValueError(f"weight sync transport {transport!r}: must be tensor, distributed or disk")
