"""Evaluate one agent's layout, and search layouts for every agent of an experiment at once.

An experiment's agents split the cluster in proportion to their cost (parameters: each learner
trains on the same ``n·B·G`` sequences and decodes at a rate set by its weight bytes), in whole
nodes when there are at least as many nodes as agents. Within its partition each agent gets the
trainer layout (TP within a node, PP, DP, sequence parallelism, recompute; distributed optimizer
on; context parallelism as the agent's config sets it, cp = 1 by default) and rollout engines that fit and give the shortest estimated step. The rollout setting the
config holds once for all agents (engine TP, memory fraction, colocated or separate GPUs) is
searched jointly; a step waits for the slowest agent in each phase (HACPO exchanges every
response before any update).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field

from hacrl_megatron.config.layout import LayoutError, pipeline_layers
from hacrl_megatron.models.provider import ArchSpec, ParallelLayoutError
from hacrl_megatron.plan.gpus import GPU
from hacrl_megatron.plan.memory import (
    GIB,
    EngineMemory,
    GPUMemory,
    Layout,
    StageMemory,
    Workload,
    engine_memory,
    most_loaded,
    trainer_memory,
)
from hacrl_megatron.plan.timing import (
    Assumptions,
    Tokens,
    probe_seconds,
    rollout_seconds,
    sync_bandwidth_gb_s,
    sync_seconds,
    train_seconds,
)

COLOCATED_FRACTIONS = (0.3, 0.4, 0.5, 0.6, 0.7)
SEPARATE_FRACTION = 0.85  # an engine alone on its GPUs (SGLang's own default is about this)
HACRL_COLOCATION = "release"  # what our trainer does with a colocated SGLang engine (docs/planner.md)


class PlanError(ValueError):
    """No plan: the message is one line naming the agent (or the cluster) and the constraint."""


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    gpu: GPU

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Rollout:
    """Where an agent's engines run and how weights reach them.

    colocation: separate | release | offload | resident (see :func:`memory.gpu_total`).
    transport: tensor (colocated) | distributed (NCCL to other GPUs) | disk."""

    colocation: str
    engine_tp: int
    fraction: float
    transport: str


@dataclass(frozen=True)
class AgentWork:
    """An agent to plan: its architecture, micro-batch shape and step token counts
    (``work.microbatches``: micro-batches per update over all DP ranks)."""

    name: str
    spec: ArchSpec
    work: Workload
    tokens: Tokens
    routing_replay: bool = False  # MoE routing replay: no full recompute with pp > 1 (config rule)
    cp: int = 1  # the agent's parallel.cp: the search keeps it (every layout splits each row over cp ranks)


@dataclass(frozen=True)
class AgentPlan:
    """One agent's evaluated layout (memory in bytes, times in seconds)."""

    name: str
    spec: ArchSpec
    gpus: int
    trainer_gpus: int
    engine_gpus: int
    layout: Layout
    rollout: Rollout | None
    engines: int
    stages: tuple[StageMemory, ...]
    peak: GPUMemory
    engine: EngineMemory | None
    reasons: tuple[str, ...]
    times: dict = field(default_factory=dict, compare=False)

    @property
    def fits(self) -> bool:
        return not self.reasons

    @property
    def seconds(self) -> float:
        """This agent's own step (rollout, π_old, train, sync), the search's ranking key."""
        t = self.times
        return sum(t.get(k, 0.0) for k in ("rollout_s", "old_logprob_s", "train_s", "sync_s"))


@functools.lru_cache(maxsize=65536)
def _stages(spec: ArchSpec, layout: Layout, work: Workload) -> tuple[StageMemory, ...]:
    return tuple(trainer_memory(spec, layout, work))


def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def _trainer_reasons(a: AgentWork, layout: Layout, peak: GPUMemory, limit: float) -> list[str]:
    if peak.total <= limit:
        return []
    st = peak.stage
    terms = {k: v for k, v in peak.terms.items() if k != "overhead"}
    term = max(terms, key=terms.get)
    hint = {
        "weights": f"{st.params / 1e9:.2f} B params per GPU at tp={layout.tp}, pp={layout.pp}",
        "grads": f"{layout.grad_dtype} main grads of {st.params / 1e9:.2f} B params",
        "optimizer": (f"fp32 master + Adam, 12 B/param sharded over "
                      f"{f'dp={layout.dp}' if layout.cp == 1 else f'dp·cp={layout.replicas}'}" if layout.distributed_optimizer
                      else "fp32 master + Adam, 12 B/param on every DP rank without the distributed optimizer"),
        "activations": (f"recompute={layout.recompute}, {a.work.micro_batch}×{a.work.seq_len} tokens per "
                        f"micro-batch, {min(layout.pp - st.stage, a.work.microbatches)} in flight"),
        "engine": {"resident": "the colocated engine keeps its share while the trainer runs",
                   "release": "the colocated engine's share while the trainer's weights, grads and optimizer stay",
                   "offload": "the colocated engine's share while the trainer's bf16 weights stay"}.get(
                       peak.colocation, "the engine's share"),
    }[term]
    return [f"agent {a.name!r}: stage {st.stage} needs {_gib(peak.total)} per GPU ({peak.phase} phase), over "
            f"{limit / GIB:.1f} GiB by {_gib(peak.total - limit)}; largest term {term} {_gib(terms[term])} ({hint})"]


def _engine_reasons(a: AgentWork, eng: EngineMemory, rollout: Rollout, gpu_gib: float) -> list[str]:
    context = a.tokens.prompt_len + a.tokens.max_response_len
    if eng.kv_cache <= 0:
        return [f"agent {a.name!r}: rollout engine TP{eng.tp}: weights {_gib(eng.weights)} + runtime "
                f"{_gib(eng.runtime)} exceed its share {_gib(eng.share)} ({rollout.fraction:g} × {gpu_gib:g} GiB)"]
    if eng.sequences(context) < 1:
        return [f"agent {a.name!r}: rollout engine TP{eng.tp}: KV cache {_gib(eng.kv_cache)} holds "
                f"{eng.kv_tokens} tokens, less than one {context}-token sequence"]
    return []


def evaluate(a: AgentWork, layout: Layout, cluster: Cluster, rollout: Rollout | None, *, gpus: int | None = None,
             engine_gpus: int = 0, assumptions: Assumptions = Assumptions()) -> AgentPlan:
    """Memory, fit and times of ``layout`` (+ ``rollout`` engines on ``engine_gpus`` separate GPUs,
    or on the trainer's GPUs when colocated). Raises :class:`PlanError` for impossible layouts."""
    # micro-batches are counted per update over all DP ranks; each rank pipelines its share
    work = dataclasses.replace(a.work, microbatches=max(1, a.work.microbatches // layout.dp))
    a = dataclasses.replace(a, work=work)
    try:
        stages = _stages(a.spec, layout, work)
    except ParallelLayoutError as err:
        raise PlanError(f"agent {a.name!r}: {err}") from None
    limit = cluster.gpu_memory_gib * GIB
    eng, engines, share, colocation = None, 0, 0.0, "separate"
    reasons: list[str] = []
    if rollout is not None:
        if a.spec.num_heads % rollout.engine_tp:
            raise PlanError(f"agent {a.name!r}: engine tp={rollout.engine_tp} does not divide "
                            f"num_attention_heads={a.spec.num_heads}")
        eng = engine_memory(a.spec, rollout.engine_tp, rollout.fraction, cluster.gpu_memory_gib)
        colocation = rollout.colocation
        engines = (layout.gpus if colocation != "separate" else engine_gpus) // rollout.engine_tp
        share = eng.share if colocation != "separate" else 0.0
        reasons += _engine_reasons(a, eng, rollout, cluster.gpu_memory_gib)
        if engines < 1:
            reasons.append(f"agent {a.name!r}: no GPU left for a TP{rollout.engine_tp} rollout engine")
    peak = most_loaded(list(stages), share, colocation)
    reasons = _trainer_reasons(a, layout, peak, limit) + reasons
    times = _times(a, layout, cluster.gpu, rollout, eng, engines, assumptions)
    total = gpus if gpus is not None else layout.gpus + engine_gpus
    return AgentPlan(a.name, a.spec, total, layout.gpus, engine_gpus if colocation == "separate" else layout.gpus,
                     layout, rollout, engines, stages, peak, eng, tuple(reasons), times)


def _times(a: AgentWork, layout: Layout, gpu: GPU, rollout: Rollout | None, eng: EngineMemory | None,
           engines: int, assumptions: Assumptions) -> dict:
    times = train_seconds(a.spec, layout, gpu, a.tokens, assumptions)
    if rollout is None or eng is None or engines < 1 or eng.kv_tokens < a.tokens.prompt_len + a.tokens.max_response_len:
        return times
    hacpo = rollout_seconds(a.spec, eng, engines, gpu, a.tokens.own_sequences, a.tokens, assumptions)
    gspo2 = rollout_seconds(a.spec, eng, engines, gpu, 2 * a.tokens.prompts * a.tokens.samples, a.tokens,
                            assumptions)
    transfer = sync_seconds(a.spec, rollout.transport, gpu, assumptions)
    bandwidth = sync_bandwidth_gb_s(rollout.transport, gpu, assumptions)
    probe = probe_seconds(a.spec, layout, rollout.engine_tp, gpu, a.tokens, assumptions)
    times.update(rollout_s=hacpo["seconds"], gspo_x2_rollout_s=gspo2["seconds"],
                 decode_tokens_per_s_per_engine=hacpo["decode_tokens_per_s_per_engine"],
                 decode_concurrency=hacpo["concurrency"], decode_steps=hacpo["decode_steps"],
                 sync_s=transfer + probe, sync_transfer_s=transfer, sync_bandwidth_gb_s=bandwidth, probe_s=probe)
    return times


# --------------------------------------------------------------------------------------------
# search


def tp_options(spec: ArchSpec, cluster: Cluster) -> list[int]:
    """Tensor-parallel sizes within one node that divide heads, KV heads and the FFN width."""
    out = []
    t = 1
    while t <= cluster.gpus_per_node:
        if spec.num_heads % t == 0 and spec.num_kv_heads % t == 0 and spec.ffn_hidden_size % t == 0:
            out.append(t)
        t *= 2
    return out


def pp_options(spec: ArchSpec) -> list[int]:
    """Pipeline sizes: the divisors of the layer count; for MoE models also the powers of two that
    split the layers unevenly (Qwen3-235B-A22B's 94 layers over PP4: 23/24/24/23)."""
    out = {p for p in range(1, spec.num_layers + 1) if spec.num_layers % p == 0}
    if spec.is_moe:
        for p in (2, 4, 8, 16, 32):
            try:
                pipeline_layers(spec.num_layers, p)
                out.add(p)
            except LayoutError:
                pass
    return sorted(out)


def ep_options(spec: ArchSpec, tp: int, dp: int) -> list[tuple[int, int]]:
    """(ep, etp) choices: dense models (1, 1); MoE models EP over powers of two that divide the
    experts and the ``tp·dp`` ranks (``dp``: dp·cp under context parallelism) with ETP = 1, or EP = 1
    with the experts split like attention."""
    if not spec.is_moe:
        return [(1, 1)]
    out = [(1, tp)] if spec.moe_ffn_hidden_size % tp == 0 else []
    ep = 2
    while ep <= tp * dp and spec.num_experts % ep == 0:
        if (tp * dp) % ep == 0:
            out.append((ep, 1))
        ep *= 2
    return out


def layouts(spec: ArchSpec, gpus: int, cluster: Cluster, routing_replay: bool = False, cp: int = 1) -> list[Layout]:
    """Every trainer layout on exactly ``gpus`` GPUs (sequence parallel whenever tp > 1, the
    distributed optimizer on: both only save memory; MoE models also over the expert layouts;
    with routing replay never full recompute over several pipeline stages), at context-parallel size
    ``cp`` (the agent's own; the search does not vary it)."""
    out = []
    for tp in tp_options(spec, cluster):
        for pp in pp_options(spec):
            if gpus % (tp * pp * cp):
                continue
            dp = gpus // (tp * pp * cp)
            for ep, etp in ep_options(spec, tp, dp * cp):
                for recompute in ("none", "selective", "full"):
                    if routing_replay and recompute == "full" and pp > 1:
                        continue
                    out.append(Layout(tp, pp, dp, tp > 1, recompute, True, ep=ep, etp=etp, cp=cp))
    return out


def _splits(gpus: int, cluster: Cluster, rollout: Rollout) -> list[tuple[int, int]]:
    """(trainer GPUs, engine GPUs) choices for one agent's partition."""
    if rollout.colocation != "separate":
        return [(gpus, 0)]
    unit = cluster.gpus_per_node if gpus >= 2 * cluster.gpus_per_node else rollout.engine_tp
    out = []
    for engine in range(unit, gpus, unit):
        if engine % rollout.engine_tp == 0:
            out.append((gpus - engine, engine))
    return out


def _rank(p: AgentPlan) -> tuple:
    order = {"none": 0, "selective": 1, "full": 2}
    return (p.seconds, p.peak.total, p.layout.pp, p.layout.tp, order[p.layout.recompute], p.layout.ep)


def shortfall(p: AgentPlan, cluster: Cluster) -> float:
    """Bytes by which ``p`` misses: the trainer GPU over its memory plus an engine's missing share."""
    over = max(0.0, p.peak.total - cluster.gpu_memory_gib * GIB)
    if p.engine is not None:
        context = p.engine.kv_bytes_per_token * 1.0  # at least one token of KV cache
        over += max(0.0, context - p.engine.kv_cache)
    return over + (0.0 if p.engines >= 1 or p.rollout is None else GIB)


def best_for_agent(a: AgentWork, gpus: int, cluster: Cluster, rollout: Rollout, assumptions: Assumptions,
                   engine_gpus: int | None = None) -> tuple[AgentPlan | None, AgentPlan | None]:
    """(fastest fitting plan or None, the plan that came closest to fitting): the trainer on ``gpus``
    GPUs and, when separate, engines on ``engine_gpus`` other GPUs (None: split ``gpus`` between them)."""
    best = closest = None
    if a.spec.num_heads % rollout.engine_tp:
        return None, None
    if rollout.colocation == "separate" and engine_gpus is not None:
        splits = [(gpus, engine_gpus)]
    else:
        splits = _splits(gpus, cluster, rollout)
    for trainer, engine in splits:
        for layout in layouts(a.spec, trainer, cluster, a.routing_replay, a.cp):
            p = evaluate(a, layout, cluster, rollout, gpus=trainer + engine if engine_gpus is not None else gpus,
                         engine_gpus=engine, assumptions=assumptions)
            if p.fits and (best is None or _rank(p) < _rank(best)):
                best = p
            if closest is None or shortfall(p, cluster) < shortfall(closest, cluster):
                closest = p
    return best, closest


def partition(costs: list[float], cluster: Cluster) -> list[int]:
    """GPUs per agent, in proportion to ``costs``: whole nodes when there are at least as many
    nodes as agents (largest remainder, at least one node each), else power-of-two GPU counts
    within the cluster that come closest to the proportions."""
    n = len(costs)
    if cluster.total_gpus < n:
        raise PlanError(f"cluster: {cluster.total_gpus} GPU(s) cannot host {n} agents (one GPU each at least)")
    share = [c / sum(costs) for c in costs]
    if cluster.nodes >= n:
        ideal = [s * cluster.nodes for s in share]
        nodes = [max(1, math.floor(x)) for x in ideal]
        while sum(nodes) > cluster.nodes:
            nodes[max(range(n), key=lambda i: nodes[i] - ideal[i])] -= 1
        while sum(nodes) < cluster.nodes:
            nodes[max(range(n), key=lambda i: ideal[i] - nodes[i])] += 1
        return [k * cluster.gpus_per_node for k in nodes]
    sizes = [2**k for k in range(int(math.log2(cluster.total_gpus)) + 1)]
    ideal = [s * cluster.total_gpus for s in share]
    combos = [c for c in itertools.product(sizes, repeat=n) if sum(c) <= cluster.total_gpus]
    return list(min(combos, key=lambda c: (cluster.total_gpus - sum(c), sum(abs(x - y) for x, y in zip(c, ideal)))))


def rollout_choices(cluster: Cluster, specs: list[ArchSpec], colocation: str, transport: str) -> list[Rollout]:
    """The experiment-wide rollout settings to try (engine TP within a node, memory fraction)."""
    tps = [t for t in (1, 2, 4, 8) if t <= cluster.gpus_per_node and all(s.num_heads % t == 0 for s in specs)]
    out = []
    for tp in tps:
        if colocation == "separate":
            out.append(Rollout("separate", tp, SEPARATE_FRACTION, "distributed" if transport == "auto" else transport))
        else:
            out += [Rollout(colocation, tp, f, "tensor" if transport == "auto" else transport)
                    for f in COLOCATED_FRACTIONS]
    return out
