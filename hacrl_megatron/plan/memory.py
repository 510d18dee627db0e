"""Per-GPU memory of a Megatron agent and of its rollout engine, term by term (bytes).

Model state (Megatron's accounting, mixed precision with Adam): bf16 weights 2 B/param, fp32 main
gradients 4 B/param (our DDP reduces gradients in fp32), fp32 master weights + Adam moments
12 B/param; 18 B/param in all, or ``6 + 12/DP`` when the distributed optimizer shards the 12 over
the data-parallel ranks. fp32 models (the CPU demo) have no master copy: 4 + 4 + 8/DP. An MoE
model's routed experts are sharded by the distributed optimizer over the expert-data-parallel group
instead, ``EDP = tp·cp·dp / (ep·etp)`` ranks (each expert shard has that many replicas). Context
parallelism (``cp``) replicates the weights like data parallelism: megatron-core's DDP and distributed
optimizer work over the dp × cp group, so the optimizer state is sharded over ``dp·cp`` ranks.

Activations: Korthikanti et al. 2022 (arXiv 2205.05198), Sec. 4 and Table 2, with the layer's
tensors counted for its real shapes (SwiGLU, grouped-query attention, no dropout) by the same
method; for the GPT-3 shape (4h GeLU MLP, full multi-head attention, dropout, eager attention)
:func:`layer_activation_bytes` gives the paper's Table 2 exactly. With 1F1B pipelining, stage ``i``
of ``p`` keeps ``min(p − i, micro-batches)`` micro-batches in flight (Sec. 4.2.3: the first stage
holds ``p``). MoE layers keep, per token, the ``k`` routed copies of the expert input and the
experts' inner tensors at width ``k·f_e / etp`` (balanced routing: each expert-parallel rank
receives as many token copies as it sends), plus the router's fp32 probabilities ``4·E`` bytes.
Under context parallelism every rank holds ``s/cp`` tokens of each row (agents/context_parallel.py), so
every per-token term is counted at ``s/cp`` (``s`` padded to a multiple of 2·cp); the ring's in-flight key/value blocks (two chunks of
``s/cp`` tokens' K and V per layer, freed after the layer) are not counted.

The last stage's log-prob head follows the trainer: ``agents.logprob_path.logprob_path`` (the
function ``LocalAgent`` builds its head from) picks the path for the workload's ``logprob_impl`` and
the layout's sequence parallelism, and only its ``megatron`` path holds materialised logits
(:func:`head_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hacrl_megatron.agents import logprob_path as paths
from hacrl_megatron.config.layout import LayoutError, expert_data_parallel, pipeline_layers
from hacrl_megatron.models.provider import RECOMPUTE, ArchSpec
from hacrl_megatron.plan.params import stage_param_split

GIB = 2**30
OVERHEAD_GIB = 2.0  # CUDA context, NCCL buffers, allocator fragmentation, per trainer GPU
ENGINE_RUNTIME_GIB = 2.0  # inside the engine's share: its activations, CUDA graphs, sampler buffers
ENGINE_RESIDUAL_GIB = 1.0  # a released engine's process (CUDA context) while the trainer runs
FUSED_WORKSPACE_BYTES = 2**27 * 2  # our log-prob kernel's one [N, V_c] bf16 slice in backward (~2^27)
COLOCATION = ("separate", "release", "offload", "resident")


@dataclass(frozen=True)
class Layout:
    """A Megatron layout of one agent's trainer."""

    tp: int
    pp: int
    dp: int
    sequence_parallel: bool = False
    recompute: str = "full"  # none | selective | full
    distributed_optimizer: bool = True
    grad_dtype: str = "float32"  # main gradients: float32 (ours: grad_reduce_in_fp32) | bfloat16
    ep: int = 1  # expert parallel (MoE): experts over ep of the tp·cp·dp ranks of a stage
    etp: int = 1  # expert tensor parallel
    cp: int = 1  # context parallel: each row split over cp ranks (TE's ring attention)

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}: must be one of {list(RECOMPUTE)}")
        if self.grad_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"grad_dtype={self.grad_dtype!r}: must be float32 or bfloat16")
        if min(self.tp, self.pp, self.dp, self.cp) < 1:
            raise ValueError(f"tp={self.tp}, pp={self.pp}, cp={self.cp}, dp={self.dp}: sizes must be >= 1")
        try:
            expert_data_parallel(self.tp, self.dp, self.ep, self.etp, self.cp)
        except LayoutError as err:
            raise ValueError(str(err)) from None

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size tp·cp·dp / (ep·etp)."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def replicas(self) -> int:
        """Ranks holding the same weight shard, over which the distributed optimizer shards: dp·cp."""
        return self.dp * self.cp

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def rank_tokens(self, seq_len: int) -> int:
        """Tokens of a row of ``seq_len`` that one context-parallel rank holds: the row padded to a
        multiple of 2·cp (agents/packing.geometry_for), divided by cp; ``seq_len`` at cp = 1."""
        return seq_len if self.cp == 1 else -(-seq_len // (2 * self.cp)) * 2

    @property
    def sequence_sharded(self) -> bool:
        """Sequence parallelism in effect: asked for and tp > 1 (megatron ignores it at tp = 1)."""
        return self.sequence_parallel and self.tp > 1


@dataclass(frozen=True)
class Workload:
    """What one training micro-batch looks like.

    seq_len: tokens per sequence (prompt + response; micro-batches are padded to the longest).
    micro_batch: sequences per micro-batch. microbatches: micro-batches per DP rank and update
    (pipeline in-flight count and bubble). logprob_impl: the trainer's ``logprob_impl`` ("auto" |
    "reference" | "triton": our fused kernel, no logits; "megatron": materialised logits), which
    with the layout's sequence parallelism gives the head's path (``agents.logprob_path``).
    flash_attention: fused attention (Transformer Engine on GPU) keeps no score matrix.
    """

    seq_len: int
    micro_batch: int = 1
    microbatches: int = 64
    logprob_impl: str = "auto"
    flash_attention: bool = True

    def __post_init__(self) -> None:
        if self.logprob_impl not in paths.LOGPROB_IMPLS:
            raise ValueError(f"logprob_impl={self.logprob_impl!r}: must be one of {list(paths.LOGPROB_IMPLS)}")

    def logprob_path(self, layout: Layout) -> paths.LogProbPath:
        """The trainer's log-prob path at ``layout`` (sequence parallelism counts only with tp > 1)."""
        return paths.logprob_path(self.logprob_impl, layout.sequence_sharded)


@dataclass(frozen=True)
class StageMemory:
    """Bytes per GPU of one pipeline stage's trainer rank (one TP rank)."""

    stage: int
    params: int
    weights: float
    grads: float
    optimizer: float
    activations: float  # layers' saved activations + the last stage's log-prob head
    logits_avoided: float  # last stage: what materialised logits add over the fused kernel (either path)
    overhead: float
    logits: float = 0.0  # materialised logits inside ``activations`` (megatron path, last stage), else 0
    logprob_path: str = "fused"  # the head's path (agents.logprob_path): fused | megatron

    @property
    def static(self) -> float:
        """Memory that stays while no training step runs (weights, gradients, optimizer)."""
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.static + self.activations + self.overhead


def layer_activation_bytes(*, s: int, b: int, h: int, a: int, q: int, kv: int, f: int, t: int, sp: bool,
                           recompute: str, gated: bool = True, dropout: bool = False, flash: bool = True,
                           qk_norm: bool = False) -> float:
    """Saved activations of one transformer layer for one micro-batch on one TP rank, in bytes.

    16-bit activations, 1-byte dropout masks. ``q = heads·head_dim``, ``kv = kv_heads·head_dim``,
    ``f`` the MLP width. Korthikanti et al. 2022, Table 2:

    * ``full``: only the layer input, ``2sbh`` (``2sbh/t`` with sequence parallelism);
    * otherwise ``U + P/t + S/t`` where ``U`` (norm inputs, QKV/fc1 inputs, dropout masks:
      ``10sbh`` for GPT-3) is replicated across TP unless sequence parallelism splits it (``U/t``),
      ``P`` (Q, K, V, the projection input, the MLP's inner tensors: ``24sbh``) is split by TP, and
      ``S`` is the attention score matrices (``5as²b``) — kept only by ``none`` with eager attention
      (``selective`` recomputes them; fused attention never stores them, only a fp32 log-sum-exp).
    """
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    unpart = 8 * sbh + (2 * sbh if dropout else 0)
    part = 2 * s * b * (q + kv) + 2 * s * b * kv + 2 * s * b * q  # Q and K, V, projection input
    part += 2 * s * b * (q + kv) if qk_norm else 0  # inputs of the per-head q/k norms
    part += 2 * s * b * (2 * f + f) if gated else 2 * s * b * (f + f)  # fc1 output(s), fc2 input
    if recompute == "selective" or flash:
        scores = 4 * a * s * b if (flash and recompute == "none") else 0  # fp32 log-sum-exp per head
    else:
        scores = (2 + (3 if dropout else 0)) * a * s * s * b  # softmax out (+ dropout mask and out)
    return (unpart / t if sp else unpart) + part / t + scores / t


def _layer_bytes(spec: ArchSpec, layout: Layout, work: Workload, recompute: str) -> float:
    f = spec.ffn_hidden_size
    if spec.is_moe:  # the TP-split width whose /t equals k·f_e/etp (experts) + f_s/tp (shared expert)
        f = spec.moe_topk * spec.moe_ffn_hidden_size * layout.tp / layout.etp + spec.shared_expert_ffn_hidden_size
    out = layer_activation_bytes(
        s=layout.rank_tokens(work.seq_len), b=work.micro_batch, h=spec.hidden_size, a=spec.num_heads,
        q=spec.num_heads * spec.head_dim,
        kv=spec.num_kv_heads * spec.head_dim, f=f, t=layout.tp, sp=layout.sequence_parallel,
        recompute=recompute, flash=work.flash_attention, qk_norm=spec.qk_norm)
    if spec.is_moe and recompute != "full":  # routed copies of the expert input, router probabilities
        tokens = layout.rank_tokens(work.seq_len) * work.micro_batch / (layout.tp if layout.sequence_parallel else 1)
        out += tokens * (2 * (spec.moe_topk - 1) * spec.hidden_size + 4 * spec.num_experts)
    return out


def logits_bytes(spec: ArchSpec, layout: Layout, work: Workload, path: paths.LogProbPath) -> float:
    """Materialised logits on the last stage for one micro-batch: bf16 logits and their fp32 softmax
    for backward, ``6 B × tokens × V_pad/t`` on the ``megatron`` path; exactly 0 on the fused path."""
    if not path.materialises_logits:
        return 0.0
    return 6 * layout.rank_tokens(work.seq_len) * work.micro_batch * spec.padded_vocab_size(layout.tp) / layout.tp


def head_bytes(spec: ArchSpec, layout: Layout, work: Workload, path: paths.LogProbPath) -> float:
    """The log-prob head's saved memory on the last stage for one micro-batch (bytes, one TP rank).

    Both paths keep their input's bf16 hidden states: megatron's output layer the stage output
    (``2 B × tokens × h``, ``/t`` under sequence parallelism: it re-gathers the sequence in backward),
    our fused kernel the scored rows (``2 B × tokens × h`` on every TP rank: under sequence
    parallelism they are all-gathered, ``path.gather_rows``). Then megatron's :func:`logits_bytes`, or
    the kernel's fp32 log-sum-exp and log-prob per token plus one bounded backward slice
    (:data:`FUSED_WORKSPACE_BYTES`). Every token of the micro-batch counts as scored (an upper bound);
    a context-parallel rank scores its ``s/cp`` tokens of each row.
    """
    tokens = layout.rank_tokens(work.seq_len) * work.micro_batch
    hidden = 2 * tokens * spec.hidden_size
    if path.materialises_logits:
        return hidden / (layout.tp if layout.sequence_sharded else 1) + logits_bytes(spec, layout, work, path)
    local_logits = tokens * spec.padded_vocab_size(layout.tp) / layout.tp
    # the backward slice is at most the whole local [tokens, V_pad/tp] in bf16
    return hidden + 8 * tokens + min(FUSED_WORKSPACE_BYTES, 2 * local_logits)


def model_state_bytes(params: int, dp: int, distributed_optimizer: bool, dtype: str = "bfloat16",
                      grad_dtype: str = "float32") -> tuple[float, ...]:
    """(weights, grads, optimizer) bytes of ``params`` parameters on one GPU (module docstring;
    ``grad_dtype="bfloat16"``: gradients reduced in bf16, 2 B/param, as NeMo-RL's default)."""
    half = dtype in ("bfloat16", "float16")
    weights = params * (2 if half else 4)
    grads = params * (2 if grad_dtype == "bfloat16" and half else 4)
    optimizer = params * ((4 if half else 0) + 8)
    return float(weights), float(grads), optimizer / (dp if distributed_optimizer else 1)


def trainer_memory(spec: ArchSpec, layout: Layout, work: Workload) -> list[StageMemory]:
    """:class:`StageMemory` of every pipeline stage (raises ParallelLayoutError for bad layouts)."""
    per_stage = stage_param_split(spec, layout.tp, layout.pp, ep=layout.ep, etp=layout.etp)
    stage_layers = pipeline_layers(spec.num_layers, layout.pp)
    layer = _layer_bytes(spec, layout, work, layout.recompute)
    # full recompute re-materialises one layer of one micro-batch at a time in backward
    working = _layer_bytes(spec, layout, work, "selective") if layout.recompute == "full" else 0.0
    path = work.logprob_path(layout)
    fused, materialised = (paths.logprob_path(impl, layout.sequence_sharded) for impl in ("auto", "megatron"))
    out = []
    for i, (dense, experts) in enumerate(per_stage):
        params = dense + experts
        in_flight = min(layout.pp - i, work.microbatches)
        act = stage_layers[i] * layer * in_flight + working
        avoided = logits = 0.0
        if i == layout.pp - 1:
            act += head_bytes(spec, layout, work, path)
            logits = logits_bytes(spec, layout, work, path)
            avoided = head_bytes(spec, layout, work, materialised) - head_bytes(spec, layout, work, fused)
        weights, grads, optimizer = model_state_bytes(dense, layout.replicas, layout.distributed_optimizer,
                                                      spec.dtype, layout.grad_dtype)
        if experts:  # the experts' optimizer state is sharded over the expert-data-parallel group
            ew, eg, eo = model_state_bytes(experts, layout.expert_dp, layout.distributed_optimizer, spec.dtype,
                                           layout.grad_dtype)
            weights, grads, optimizer = weights + ew, grads + eg, optimizer + eo
        out.append(StageMemory(i, params, weights, grads, optimizer, act, avoided, OVERHEAD_GIB * GIB, logits,
                               path.name))
    return out


@dataclass(frozen=True)
class EngineMemory:
    """One rollout engine GPU: its share, the weights it holds, and the KV cache left."""

    tp: int
    share: float  # bytes the engine takes: fraction × GPU memory
    weights: float
    runtime: float
    kv_cache: float  # share − weights − runtime (negative: the engine does not fit)
    kv_bytes_per_token: float  # per GPU
    kv_tokens: int  # tokens of context the engine can hold (all its GPUs together hold the same)

    def sequences(self, seq_len: int) -> int:
        return max(0, self.kv_tokens // seq_len)


def engine_memory(spec: ArchSpec, engine_tp: int, fraction: float, gpu_memory_gib: float) -> EngineMemory:
    """An SGLang engine at ``engine_tp`` keeping ``fraction`` of each GPU (``--mem-fraction-static``:
    weights and KV cache). KV heads are split over the engine's TP and replicated when TP exceeds
    them (one head per GPU)."""
    share = fraction * gpu_memory_gib * GIB
    weights = spec.num_parameters() * 2 / engine_tp
    runtime = ENGINE_RUNTIME_GIB * GIB
    kv_cache = share - weights - runtime
    heads_per_gpu = max(1, spec.num_kv_heads // engine_tp)
    per_token = 2 * spec.num_layers * heads_per_gpu * spec.head_dim * 2
    tokens = int(kv_cache // per_token) if kv_cache > 0 else 0
    return EngineMemory(engine_tp, share, weights, runtime, kv_cache, per_token, tokens)


@dataclass(frozen=True)
class GPUMemory:
    """The most loaded trainer GPU at its peak, as the planner reports it (bytes).

    ``terms`` are those of the phase that sets the peak (they sum to ``total``): weights, grads,
    optimizer, activations, engine, overhead."""

    stage: StageMemory
    colocation: str
    phase: str  # training | rollout
    terms: dict

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def engine(self) -> float:
        return self.terms["engine"]


def phase_terms(stage: StageMemory, engine_share: float, colocation: str) -> dict[str, dict[str, float]]:
    """Bytes by term of a trainer GPU that may host an engine, per phase.

    ``separate``/no engine: the trainer alone. ``resident``: the engine keeps its share all the
    time. ``release`` (ours: SGLang ``release_memory_occupation`` while training): training phase
    = trainer + a released engine's residue; rollout phase = the trainer's weights, gradients and
    optimizer state (they stay) + the engine's share. ``offload`` (NeMo-RL, verl: the trainer's
    gradients and optimizer state go to host memory while generating): rollout phase = the bf16
    weights + the engine's share.
    """
    if colocation not in COLOCATION:
        raise ValueError(f"colocation={colocation!r}: must be one of {list(COLOCATION)}")
    train = {"weights": stage.weights, "grads": stage.grads, "optimizer": stage.optimizer,
             "activations": stage.activations, "engine": 0.0, "overhead": stage.overhead}
    if colocation == "separate" or engine_share == 0:
        return {"training": train}
    if colocation == "resident":
        return {"training": {**train, "engine": engine_share}}
    kept = colocation == "release"
    rollout = {"weights": stage.weights, "grads": stage.grads if kept else 0.0,
               "optimizer": stage.optimizer if kept else 0.0, "activations": 0.0, "engine": engine_share,
               "overhead": stage.overhead}
    return {"training": {**train, "engine": ENGINE_RESIDUAL_GIB * GIB}, "rollout": rollout}


def most_loaded(stages: list[StageMemory], engine_share: float, colocation: str) -> GPUMemory:
    """The stage and phase whose GPU peaks highest (ties: the first stage, training before rollout)."""
    best = None
    for st in stages:
        for phase, terms in phase_terms(st, engine_share, colocation).items():
            cand = GPUMemory(st, colocation, phase, terms)
            if best is None or cand.total > best.total:
                best = cand
    assert best is not None
    return best
