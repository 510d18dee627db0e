"""Step-time estimate of one HACRL step: rollout, verify, re-tokenisation, log-probs + training,
weight sync (with its probe), and the run's checkpoints and final export.

First-order models, every constant in :class:`Assumptions` and printed with the plan:

* training: ``6·N`` FLOPs per trained token (forward + backward), ``+2·N`` with full recompute
  (one more forward), at a stated MFU of the trainer GPUs' dense bf16 peak, divided by
  ``1 − bubble`` with the 1F1B bubble ``(p − 1)/(m + p − 1)`` (``m`` micro-batches per DP rank and
  update); every learner trains on the responses of the agents it learns from (``n·B·G`` when the
  method shares rollouts, its own ``B·G`` for GSPO / GRPO); context parallelism's ring exchange of
  keys and values (:func:`train_seconds`' ``cp_comm_s``) not overlapped with the attention it feeds;
* π_old: ``2·N`` per token over the sequences the loop scores before the update (:class:`Tokens`:
  every agent's own responses; with ``hacpo.cross_clip_mode: decoupled`` and ``naive_merge`` also
  every other agent's, re-tokenised; plus the frozen reference's pass over the own responses when
  ``hacpo.kl_coef > 0``);
* rollout: decode is memory-bandwidth bound: each step reads the engine's weights and the batch's
  KV cache from HBM at a stated fraction of peak bandwidth (or is compute bound at ``2·N`` FLOPs
  per token, whichever is slower); continuous batching keeps as many sequences decoding as the KV
  cache holds at full length, and the longest response is the floor on the number of steps;
  prefill at ``2·N`` per prompt token;
* verify: every response scored once by the shared verifier pool at a stated cost per response,
  spread over its worker processes;
* re-tokenisation: the controller decodes and re-encodes every cross response whose source uses a
  different tokenizer, at a stated cost per response token, once for the learner batch and once more
  for the π_old pass over others' responses;
* weight sync: the bf16 HF weights once per step over the transport's link at a stated efficiency
  (:func:`sync_bandwidth_gb_s`, an assumption printed with its source next to what the package
  measured of its own push on CPU, :data:`MEASURED_SYNC_S_PER_GB`), then the probe (one sequence
  through the trainer and the engine, :func:`probe_seconds`);
* checkpoint and export (:func:`checkpoint_seconds`, :func:`export_seconds`): bytes over the shared
  filesystem's bandwidth, per checkpoint and once at the end; what a save costs the step is
  :func:`checkpoint_wait_seconds`: the copy of each GPU's share to host memory
  (:func:`snapshot_seconds`) plus, with ``checkpoint.async_save``, only the part of the write that
  the steps until the next save do not cover (the whole write without it).

The step is the schedule the loop runs (:func:`step_seconds`): the stages rollout → verify →
re-tokenise → π_old → train → sync run one after another, each for every agent at once, so each
stage takes its slowest agent's time (verify and re-tokenisation are the controller's, one value
for all agents). :func:`sequential_step_seconds` is the previous loop's schedule (rollout, π_old and
sync one agent after another, training concurrent), kept for comparison;
:func:`overlapped_step_seconds` is the steady-state step when rollout overlaps the rest
(``train.rollout_mode: one_step_off`` or ``async``).

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
    verify_ms_per_response: float = 10.0  # one verifier check (math-verify: 1-230 ms measured; the
    # string normaliser well under 1 ms), per worker process
    retokenize_us_per_token: float = 7.5  # Exchange.views of one cross response token on the controller
    # (decode, re-encode, decode back, Python bookkeeping): 7.5-7.9 µs measured with one or two Rust
    # threads on a loaded 2-core machine (benchmarks/bench_retokenize.py), an upper figure
    checkpoint_bytes_per_param: float = 14.0  # bf16 weights + fp32 master weights and Adam's two moments
    host_copy_gbps: float = 10.0  # device → host copy of one GPU's checkpoint share (every GPU at once; pageable
    # host memory: pinned copies reach 25-50 GB/s on PCIe Gen4/Gen5)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Tokens:
    """One step's sequence counts for one agent (B prompts, G samples, n agents) under the method the
    loop runs (:class:`hacrl_megatron.algo.Algorithm`: its samples per prompt, whether it learns from
    every agent's responses, and the extra forward passes it asks for)."""

    prompts: int  # B
    samples: int  # G per agent as configured (rollout.samples_per_prompt)
    agents: int  # n
    prompt_len: int
    max_response_len: int
    updates: int  # M mini-batches per step
    micro_batch: int
    rollout_multiplier: int = 1  # GSPO×2 samples 2G per prompt
    shares_rollouts: bool = True  # learns from every agent's responses (HACPO, naive) or its own (GSPO, GRPO)
    old_on_others: bool = False  # π_old of the learner over every other agent's responses (decoupled, naive_merge)
    reference: bool = False  # the frozen reference's pass over the own responses (hacpo.kl_coef > 0)

    def mean_seq(self, a: Assumptions) -> float:
        return self.prompt_len + a.mean_response_fraction * self.max_response_len

    @property
    def own_sequences(self) -> int:
        """Responses this agent samples per step: ``B·G`` (``2·B·G`` for GSPO×2)."""
        return self.prompts * self.samples * self.rollout_multiplier

    @property
    def trained_sequences(self) -> int:
        """Sequences this learner trains on per step: every agent's responses or its own."""
        return self.agents * self.own_sequences if self.shares_rollouts else self.own_sequences

    @property
    def old_sequences(self) -> int:
        """Sequences the π_old stage runs through this agent's trainer: its own responses, the other
        agents' responses when the method needs the learner's own π_old on them, and the frozen
        reference's pass over the own responses with the KL penalty."""
        others = (self.agents - 1) * self.own_sequences if self.old_on_others else 0
        return self.own_sequences + others + (self.own_sequences if self.reference else 0)

    @property
    def step_responses(self) -> int:
        """Responses all agents sample per step (what the verifier scores)."""
        return self.agents * self.own_sequences


def train_seconds(spec: ArchSpec, layout: Layout, gpu: GPU, tok: Tokens, a: Assumptions) -> dict[str, float]:
    """Seconds per step of the π_old log-prob passes (``old_logprob_s``: one forward over
    :attr:`Tokens.old_sequences`) and of training (``train_s``: forward, backward and, with full recompute, one more
    forward; with its components ``train_compute_s``, ``tp_comm_s``, ``dp_comm_s``), and the 1F1B
    bubble fraction. Tensor-parallel exchanges and the data-parallel gradient reduction are not
    overlapped with compute (an upper bound); both passes pay the same pipeline bubble. MoE models
    count the FLOPs of the active parameters (one token's top-k experts) and add the expert-parallel
    all-to-all (``ep_comm_s``: dispatch and combine of the k routed copies of every token's hidden state
    in each forward and backward, the share (ep-1)/ep leaving the rank). Context parallelism (cp > 1)
    splits every row over cp ranks: compute and TP exchanges per rank shrink by cp, the gradient
    reduction runs over dp·cp ranks, and ``cp_comm_s`` is Transformer Engine's ring ('p2p') exchange:
    in each layer every rank passes its chunk's K and V (``2·kv_heads·head_dim/tp`` bf16 values per
    token) cp − 1 times around the ring in the forward, and K, V and their gradients in the backward
    (twice the forward's bytes), over NVLink when the tp·cp ranks of a ring fit one 8-GPU node; counted
    as not overlapped with the attention compute (TE overlaps them: an upper bound)."""
    n = spec.active_parameters()
    tokens = tok.trained_sequences * tok.mean_seq(a)
    old_share = tok.old_sequences / tok.trained_sequences  # π_old tokens per trained token
    old_flops, train_flops = 2 * n * old_share, 6 * n + (2 * n if layout.recompute == "full" else 0)
    m = max(1, tok.trained_sequences // (tok.updates * layout.dp * tok.micro_batch))  # CP ranks share them
    bubble = (layout.pp - 1) / (m + layout.pp - 1)
    per_flop = tokens / (layout.gpus * gpu.bf16_tflops * 1e12 * a.train_mfu) / (1 - bubble)
    # TP: 2 all-reduce-sized exchanges (attention and MLP outputs) per layer in each forward
    # (log-prob pass, training forward, recompute) and in backward; 2·h bytes per token each,
    # ring factor 2(t-1)/t, over NVLink; every DP replica moves its own tokens
    old_passes, train_passes = 2, 2 + (2 if layout.recompute == "full" else 0) + 2
    per_pass = tokens / (layout.dp * layout.cp) * spec.num_layers / layout.pp * 2 * spec.hidden_size
    per_pass *= 2 * (layout.tp - 1) / layout.tp / (gpu.nvlink_gbps * 1e9 * a.link_efficiency)
    # DP: reduce-scatter + all-gather of the fp32 gradients once per update (ring 2(d-1)/d); MoE
    # experts reduce over the expert-data-parallel group instead
    rate = (gpu.nvlink_gbps if layout.gpus <= 8 else gpu.network_gbps) * 1e9 * a.link_efficiency
    h = spec.hidden_size
    experts = spec.num_layers * spec.num_experts * 3 * h * spec.moe_ffn_hidden_size if spec.is_moe else 0
    dense, edp, reps = spec.num_parameters() - experts, layout.expert_dp, layout.replicas  # replicas: dp·cp
    dp_comm = tok.updates * 4 * 2 / rate * (dense / (layout.tp * layout.pp) * (reps - 1) / reps
                                            + experts / (layout.ep * layout.etp * layout.pp) * (edp - 1) / edp)
    # EP: each forward and backward dispatches and combines the k routed copies of every token (bf16)
    per_a2a = 0.0
    if spec.is_moe and layout.ep > 1:
        ep_rate = (gpu.nvlink_gbps if layout.ep * layout.etp <= 8 else gpu.network_gbps) * 1e9 * a.link_efficiency
        per_a2a = tokens / layout.dp * spec.num_layers / layout.pp * spec.moe_topk * 2 * h
        per_a2a *= (layout.ep - 1) / layout.ep / ep_rate
    old_ep, train_ep = 2 * per_a2a * old_share, 2 * per_a2a * (2 + (1 if layout.recompute == "full" else 0))
    ring = cp_ring_seconds(spec, layout, gpu, tokens, a)  # one forward's K/V exchange of every layer
    old_cp, train_cp = ring * old_share, ring * (1 + 2 + (1 if layout.recompute == "full" else 0))
    compute, tp_comm = train_flops * per_flop, train_passes * per_pass
    return {"old_logprob_s": old_flops * per_flop + old_passes * per_pass * old_share + old_ep + old_cp,
            "old_logprob_sequences": tok.old_sequences,
            "train_s": compute + tp_comm + dp_comm + train_ep + train_cp, "train_compute_s": compute,
            "tp_comm_s": tp_comm, "dp_comm_s": dp_comm, "ep_comm_s": train_ep, "cp_comm_s": train_cp,
            "pipeline_bubble": bubble}


def cp_ring_seconds(spec: ArchSpec, layout: Layout, gpu: GPU, tokens: float, a: Assumptions) -> float:
    """Seconds of one forward pass's ring exchange of keys and values under context parallelism, per
    rank, for ``tokens`` tokens (0 at cp = 1): each rank's ``tokens / (dp·cp)`` tokens' K and V of its
    stage's layers (``kv_heads·head_dim / tp`` values each, bf16) sent cp − 1 times."""
    if layout.cp == 1:
        return 0.0
    rate = (gpu.nvlink_gbps if layout.tp * layout.cp <= 8 else gpu.network_gbps) * 1e9 * a.link_efficiency
    kv = 2 * spec.num_kv_heads * spec.head_dim / layout.tp * 2  # K and V, bf16, per token
    per_rank = tokens / (layout.dp * layout.cp) * spec.num_layers / layout.pp * kv
    return per_rank * (layout.cp - 1) / rate


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


# What the package measured of its own weight push, next to the bandwidths the plan assumes: seconds per GB
# of bf16 weights on gloo over loopback on the CPU machine kind (2 shared cores), a TP2·PP2 trainer world into
# one stand-in SGLang server (benchmarks/bench_weight_sync.py --stages, docs/weight_sync.md). Not a GPU link:
# it bounds the code's own overheads, and shows the stage-parallel push ahead of the rank-0 funnel.
MEASURED_SYNC_S_PER_GB = {"stages_gloo_cpu": 3.62, "rank0_funnel_gloo_cpu": 5.86}
MEASURED_SYNC_SOURCE = ("benchmarks/bench_weight_sync.py --stages: TP2·PP2 gloo world over loopback on a 2-core CPU "
                        "machine into one stand-in SGLang server, 0.34 GB bf16 in 64 MiB buckets")


def sync_bandwidth_gb_s(transport: str, gpu: GPU, a: Assumptions) -> float:
    """The bandwidth (GB/s of bf16 HF weights) the plan assumes for one weight push by ``transport``:
    ``tensor`` over NVLink, ``distributed`` over the slower of the network and NVLink (every engine
    rank receives the whole model: from rank 0, or from each pipeline stage's sender in turn), both at
    ``link_efficiency``; ``disk``: written and read back at ``disk_gbps``."""
    if transport == "tensor":
        return gpu.nvlink_gbps * a.link_efficiency
    if transport == "distributed":
        return min(gpu.network_gbps, gpu.nvlink_gbps) * a.link_efficiency
    if transport == "disk":
        return a.disk_gbps / 2
    raise ValueError(f"weight sync transport {transport!r}: must be tensor, distributed or disk")


def sync_bandwidth_source(transport: str, gpu: GPU, a: Assumptions) -> str:
    """Where :func:`sync_bandwidth_gb_s` comes from, in words (printed with the plan)."""
    if transport == "tensor":
        return f"assumed: {gpu.name} NVLink {gpu.nvlink_gbps:g} GB/s x link_efficiency {a.link_efficiency:g}"
    if transport == "distributed":
        return (f"assumed: min(network {gpu.network_gbps:g}, NVLink {gpu.nvlink_gbps:g}) GB/s per GPU x "
                f"link_efficiency {a.link_efficiency:g}")
    return f"assumed: disk_gbps {a.disk_gbps:g} GB/s, written then read"


def sync_seconds(spec: ArchSpec, transport: str, gpu: GPU, a: Assumptions) -> float:
    """Weight sync of the bf16 HF weights: ``tensor`` (colocated, CUDA IPC over NVLink-gathered
    shards), ``distributed`` (NCCL broadcast to engines on other nodes), ``disk`` (write + read),
    each at :func:`sync_bandwidth_gb_s` (assumed, not measured on GPUs: :data:`MEASURED_SYNC_S_PER_GB`
    is what the package measured on CPU)."""
    return spec.num_parameters() * 2 / (sync_bandwidth_gb_s(transport, gpu, a) * 1e9)


def verify_seconds(tok: Tokens, workers: int, a: Assumptions) -> float:
    """The shared verifier scores each of the step's ``n·B·G`` responses once, ``workers`` processes
    at a time (0 workers: in the controller, one at a time)."""
    return tok.step_responses * a.verify_ms_per_response / 1e3 / max(1, workers)


def retokenize_seconds(cross_responses: int, tok: Tokens, a: Assumptions) -> float:
    """The controller's re-tokenisation per step: ``cross_responses`` re-encoded cross responses
    (summed over learners and passes, :func:`hacrl_megatron.plan.experiment.cross_responses`) of
    ``mean_response_fraction · max_response_len`` tokens each."""
    mean_response = a.mean_response_fraction * tok.max_response_len
    return cross_responses * mean_response * a.retokenize_us_per_token / 1e6


def probe_seconds(spec: ArchSpec, layout: Layout, engine_tp: int, gpu: GPU, tok: Tokens, a: Assumptions) -> float:
    """The post-sync check of one agent (``sync.check_sync``): one mean-length sequence forward through
    the trainer (its pipeline stages in turn, each on ``tp·cp`` GPUs: ``2·N·L / (tp·cp)``) and prefilled by
    one engine (``2·N·L / engine_tp``), at the training and decode MFU."""
    flops = 2 * spec.active_parameters() * tok.mean_seq(a)
    peak = gpu.bf16_tflops * 1e12
    return flops / (layout.tp * layout.cp * peak * a.train_mfu) + flops / (engine_tp * peak * a.decode_mfu)


def checkpoint_seconds(parameters: list[int], a: Assumptions) -> float:
    """One checkpoint's write (``trainer/checkpoint.py``): every agent writes at once
    (``checkpoint_bytes_per_param`` per parameter: bf16 weights and the fp32 optimizer state), all
    over the shared filesystem's bandwidth; each file is hashed for the manifest as it is written,
    so nothing is read back."""
    nbytes = sum(parameters) * a.checkpoint_bytes_per_param
    return nbytes / (a.disk_gbps * 1e9)


def checkpoint_rank_bytes(rank_parameters: int, optimizer_shards: int, a: Assumptions) -> float:
    """Bytes of one rank's share of a checkpoint: its ``rank_parameters`` once as bf16 weights (a DP
    replica's first rank writes them), plus the fp32 optimizer state (the rest of
    ``checkpoint_bytes_per_param``) over the ``optimizer_shards`` ranks the distributed optimizer
    spreads it on (DP; 1 without it: the first replica writes it all)."""
    weights = 2.0
    return rank_parameters * (weights + (a.checkpoint_bytes_per_param - weights) / max(1, optimizer_shards))


def snapshot_seconds(rank_bytes: float, a: Assumptions) -> float:
    """The copy of the largest rank's share of a checkpoint (:func:`checkpoint_rank_bytes`) from GPU to
    host memory; every rank copies at once, and the save starts writing after it."""
    return rank_bytes / (a.host_copy_gbps * 1e9)


def checkpoint_wait_seconds(write_s: float, snapshot_s: float, interval_s: float, asynchronous: bool) -> float:
    """Seconds one save holds the loop (the checkpoint's cost on the critical path). Synchronous: the
    copy to host memory and the whole write. Asynchronous (``checkpoint.async_save``): the copy, plus
    whatever of the previous save's write the ``interval_s`` of steps since it did not cover."""
    if not asynchronous:
        return snapshot_s + write_s
    return snapshot_s + max(0.0, write_s - interval_s)


def export_seconds(parameters: list[int], a: Assumptions) -> float:
    """The final HF export of every agent, one after another: bf16 weights written once."""
    return sum(parameters) * 2 / (a.disk_gbps * 1e9)


def checkpoints_per_run(steps: int, every: int) -> int:
    """Checkpoints a run of ``steps`` writes with ``checkpoint.every`` (the loop also saves the last step)."""
    if not every:
        return 0
    return steps // every + (1 if steps % every else 0)


# per-agent stages in the order the loop runs them; verify and re-tokenisation are the controller's
STAGES = ("rollout_s", "verify_s", "retokenize_s", "old_logprob_s", "train_s", "sync_s")
CONTROLLER_STAGES = ("verify_s", "retokenize_s")
SCHEDULE = ("rollout -> verify -> re-tokenise -> pi_old -> train -> sync (+ probe), each stage for all agents at "
            "once: step = sum over stages of the slowest agent's stage time (verify and re-tokenisation: the "
            "controller's)")


def step_seconds(agents: list[dict[str, float]], verify_s: float, retokenize_s: float = 0.0) -> dict[str, float]:
    """The step of the loop's schedule: each stage runs for every agent at once and waits for the
    slowest, the stages run one after another, so ``step = Σ_stage max_agent t(agent, stage)``.
    ``agents``: each agent's stage times (missing stages count 0); ``verify_s``, ``retokenize_s``:
    the controller's stages; returns each stage's time (its slowest agent) and ``total_s``."""
    out = {k: max(t.get(k, 0.0) for t in agents) for k in STAGES if k not in CONTROLLER_STAGES}
    out.update(verify_s=verify_s, retokenize_s=retokenize_s)
    out = {k: out[k] for k in STAGES}
    out["total_s"] = sum(out.values())
    return out


def sequential_step_seconds(agents: list[dict[str, float]], verify_s: float, retokenize_s: float = 0.0) -> float:
    """The previous loop's step: rollout, the π_old passes and weight sync one agent after another
    (``Σ_agent``), training concurrent (``max_agent``); for comparison with :func:`step_seconds`."""
    total = sum(t.get(k, 0.0) for t in agents for k in ("rollout_s", "old_logprob_s", "sync_s"))
    return total + verify_s + retokenize_s + max(t.get("train_s", 0.0) for t in agents)


def separate_jobs_seconds(agents: dict[str, dict[str, float]], verify_s: float,
                          retokenize_s: float = 0.0) -> dict[str, dict[str, float]]:
    """Each agent as its own job (``hacrl train --agent``, docs/exchange.md): per agent, ``own_s`` (its step
    alone: rollout, verify of its own responses, π_old, re-tokenise, train, sync), ``barrier_wait_s`` (how
    long it waits per step at the exchange) and ``step_s`` (the two together). Steady state: the barrier of
    step t+1 comes ``max_j own_j`` after that of step t (each job publishes its record ``rollout + verify +
    π_old`` into its step, which starts ``re-tokenise + train + sync`` after the previous barrier), so every
    job advances at the slowest job's pace and waits the difference. A job verifies and re-tokenises its own
    share (``1/n``) of the controller's work. The exchange's own cost (a record's write and read,
    benchmarks/bench_agent_jobs.py) is not counted."""
    n = max(len(agents), 1)
    own = {name: t.get("rollout_s", 0.0) + (verify_s + retokenize_s) / n + t.get("old_logprob_s", 0.0)
           + t.get("train_s", 0.0) + t.get("sync_s", 0.0) for name, t in agents.items()}
    period = max(own.values(), default=0.0)
    return {name: {"own_s": mine, "barrier_wait_s": period - mine, "step_s": period} for name, mine in own.items()}


def overlapped_step_seconds(stages: dict[str, float]) -> float:
    """Steady-state step when the rollout of step t+1 runs while step t verifies, computes π_old,
    trains and syncs (``one_step_off``; ``async`` with any staleness bound K ≥ 1 has the same bound:
    rollout cannot produce faster than its own time per step, training cannot consume faster than
    the rest): ``max(rollout, verify + re-tokenise + π_old + train + sync)`` from :func:`step_seconds`' stages.
    Assumes the engines run on GPUs of their own (the weight push waits only for the sync itself)."""
    rest = sum(v for k, v in stages.items() if k in STAGES and k != "rollout_s")
    return max(stages["rollout_s"], rest)
