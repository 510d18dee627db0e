"""Plan a whole experiment config on a cluster: every agent's layout, engines and config overrides.

The result carries the overrides (dotted ``key=value``) and a self-contained preset YAML; both are
validated with :func:`hacrl_megatron.config.load_config`'s rules before they are returned, so
``hacrl train`` / ``hacrl launch`` accept them unchanged.
"""

from __future__ import annotations

import copy
import functools
import itertools
import os
from dataclasses import dataclass

import yaml

from hacrl_megatron.config import (
    AgentConfig,
    ConfigError,
    ExperimentConfig,
    apply_override,
    from_dict,
    validate,
)
from hacrl_megatron.launch.placement import (
    Engine,
    Span,
    engine_slots,
    free_gpus,
    place_engines,
    place_trainers,
    split_engines,
)
from hacrl_megatron.models.dtype import resolve_model_dtype
from hacrl_megatron.models.provider import ArchSpec, UnsupportedModelError
from hacrl_megatron.plan.known_models import KNOWN_CONFIGS
from hacrl_megatron.plan.memory import ENGINE_RUNTIME_GIB, GIB, Workload, engine_memory
from hacrl_megatron.plan.params import arch_from_config, rank_params
from hacrl_megatron.plan.search import (
    HACRL_COLOCATION,
    AgentPlan,
    AgentWork,
    Cluster,
    PlanError,
    Rollout,
    best_for_agent,
    evaluate,
    partition,
    rollout_choices,
    shortfall,
)
from hacrl_megatron.plan.timing import (
    SCHEDULE,
    Assumptions,
    Tokens,
    checkpoint_rank_bytes,
    checkpoint_seconds,
    checkpoint_wait_seconds,
    checkpoints_per_run,
    export_seconds,
    overlapped_step_seconds,
    retokenize_seconds,
    separate_jobs_seconds,
    sequential_step_seconds,
    snapshot_seconds,
    step_seconds,
    verify_seconds,
)

MODES = ("sync", "one_step_off", "async")  # train.rollout_mode


@dataclass(frozen=True)
class ExperimentPlan:
    """The chosen layout of every agent and what the step costs."""

    agents: tuple[AgentPlan, ...]
    rollout: Rollout | None
    cluster: Cluster
    assumptions: Assumptions
    step: dict  # each stage's time, total_s, sequential_s, one_step_off_s, async_s, GSPO×2 (:func:`_step`)
    overrides: tuple[str, ...]
    preset_yaml: str
    sources: tuple[str, ...]  # where each agent's architecture came from
    notes: tuple[str, ...]
    placement: Placement
    objective: str = "sync"  # the rollout mode whose step the search minimised


def agent_spec(agent: AgentConfig, engine: str | None = None) -> tuple[ArchSpec, str]:
    """The agent's :class:`ArchSpec` without weights: ``model.hf_path``'s config.json, else the
    built-in copy of a known model's config (folder not downloaded yet), else the model sizes; in the
    dtype it trains in with the rollout ``engine`` on the planned GPUs (models/dtype.py)."""
    m = agent.model
    if m.hf_path:
        path = os.path.join(m.hf_path, "config.json")
        name = os.path.basename(os.path.normpath(m.hf_path))
        try:
            if os.path.isfile(path):
                return _with_dtype(arch_from_config(path), agent, engine), path
            if name in KNOWN_CONFIGS:
                return _with_dtype(arch_from_config(KNOWN_CONFIGS[name]), agent, engine), f"built-in config of {name}"
        except UnsupportedModelError as err:
            raise PlanError(f"agent {agent.name!r}: {err}") from None
        raise PlanError(f"agent {agent.name!r}: model.hf_path={m.hf_path!r} has no config.json and is not a known "
                        f"model ({sorted(KNOWN_CONFIGS)})")
    from hacrl_megatron.exchange.tokenizers import load_tokenizer
    from hacrl_megatron.models.provider import arch_from_model_config

    vocab = m.vocab_size or len(load_tokenizer(agent.tokenizer))
    return arch_from_model_config(m, vocab), f"model sizes in the config (vocab {vocab} from the tokenizer)"


def _with_dtype(spec: ArchSpec, agent: AgentConfig, engine: str | None) -> ArchSpec:
    """``spec`` (in its checkpoint's dtype) in the dtype ``agent`` trains in on the GPUs planned for: an
    explicit ``model.dtype``, or ``auto``'s rule (models/dtype.py) with CUDA."""
    import dataclasses

    dtype = resolve_model_dtype(agent.model.dtype, spec.dtype, cuda=True, backend=agent.backend, engine=engine)
    return dataclasses.replace(spec, dtype=dtype)


def step_tokens(cfg: ExperimentConfig) -> Tokens:
    """One agent's step :class:`Tokens` under the method the loop builds from ``cfg.hacpo``
    (:func:`hacrl_megatron.algo.build_algorithm`: its samples per prompt, shared or own rollouts,
    and the π_old / reference passes it asks for)."""
    from hacrl_megatron.algo import build_algorithm

    r, t = cfg.rollout, cfg.train
    method = build_algorithm(cfg.hacpo, len(cfg.agents))
    passes = method.passes
    return Tokens(prompts=t.prompts_per_step, samples=r.samples_per_prompt, agents=len(cfg.agents),
                  prompt_len=r.max_prompt_len, max_response_len=r.max_response_len, updates=t.mini_batches,
                  micro_batch=t.micro_batch_size, rollout_multiplier=method.samples_per_prompt(1),
                  shares_rollouts=method.shares_rollouts, old_on_others=passes.learner_old_on_others,
                  reference=passes.reference_on_self)


def cross_responses(cfg: ExperimentConfig, works: list[AgentWork]) -> int:
    """Cross responses the controller re-encodes per step (``Exchange.views``): for every learner,
    each other agent's ``B·G`` responses when their tokenizers differ, once for the learner batch
    and once more for the π_old pass over others' responses. The loop compares tokenizer
    fingerprints; the planner, without the files, takes two agents' tokenizers as the same when
    their ``tokenizer`` entries are equal or their models' vocabularies have the same size."""
    tokens = works[0].tokens
    if not tokens.shares_rollouts:
        return 0
    keys = [(a.tokenizer, w.spec.vocab_size) for a, w in zip(cfg.agents, works)]
    differ = sum(1 for k, a in enumerate(keys) for j, b in enumerate(keys) if k != j and a[0] != b[0] and a[1] != b[1])
    return differ * tokens.own_sequences * (2 if tokens.old_on_others else 1)


def agent_works(cfg: ExperimentConfig, logprob_impl: str = "auto") -> tuple[list[AgentWork], list[str]]:
    """Each agent's :class:`AgentWork` from the config (micro-batches padded to the longest sequence;
    ``logprob_impl``: the trainers' log-prob path, as ``LocalAgent``'s argument)."""
    r, t = cfg.rollout, cfg.train
    tokens = step_tokens(cfg)
    works, sources = [], []
    for agent in cfg.agents:
        spec, source = agent_spec(agent, cfg.rollout.engine)
        micro = max(1, tokens.trained_sequences // (t.mini_batches * t.micro_batch_size))
        work = Workload(seq_len=r.max_prompt_len + r.max_response_len, micro_batch=t.micro_batch_size,
                        microbatches=micro, logprob_impl=logprob_impl)
        works.append(AgentWork(agent.name, spec, work, tokens, agent.model.moe_routing_replay, agent.parallel.cp))
        sources.append(f"{agent.name}: {source}")
    return works, sources


@dataclass(frozen=True)
class Placement:
    """Every agent's trainer GPUs (count and spans) and its engines (:mod:`hacrl_megatron.launch.placement`);
    colocated engines share the trainer's GPUs and have no GPUs of their own."""

    trainer_gpus: tuple[int, ...]
    trainers: tuple[tuple[Span, ...], ...]
    engines: tuple[tuple[Engine, ...], ...]
    colocated: bool

    def engine_gpus(self, i: int) -> int:
        return sum(e.gpus for e in self.engines[i])


def _one_node(costs: list[float], cluster: Cluster, colocated: bool, engine_tp: int = 1) -> list[Placement]:
    """One node: power-of-two GPU shares in proportion to cost. The engines colocate; or (separate)
    each agent's share is its trainer's GPUs, then its engines' (every split in whole engines, every
    combination over the agents: a stage waits for the slowest agent)."""
    gpus = partition(costs, cluster)
    starts = [sum(gpus[:i]) for i in range(len(gpus))]
    if colocated:
        trainers = tuple(((0, s, g),) for s, g in zip(starts, gpus))
        return [Placement(tuple(gpus), trainers, ((),) * len(gpus), True)]
    splits = [[e for e in range(engine_tp, g, engine_tp)] for g in gpus]
    out = []
    for engines in itertools.product(*splits):
        trainer = tuple(g - e for g, e in zip(gpus, engines))
        spans = tuple(((0, s, t),) for s, t in zip(starts, trainer))
        eng = tuple(tuple(Engine(0, s + t + k * engine_tp, engine_tp) for k in range(e // engine_tp))
                    for s, t, e in zip(starts, trainer, engines))
        out.append(Placement(trainer, spans, eng, False))
    return out


def rollout_costs(works: list[AgentWork], a: Assumptions) -> list[float]:
    """Each agent's decode FLOPs per step: its ``B·G`` sequences' tokens × ``2·N`` per token (decode
    reads every weight once per token: the same proportions as its weight bytes)."""
    return [w.tokens.prompts * w.tokens.samples * w.tokens.mean_seq(a) * 2 * w.spec.num_parameters() for w in works]


def multi_node_placements(works: list[AgentWork], cluster: Cluster, engine_tp: int,
                          a: Assumptions = Assumptions()) -> list[Placement]:
    """The candidate placements on several nodes: for each count ``E`` of nodes left to engines, the
    trainers split the other nodes by training cost (:func:`~.search.partition`), and every free GPU
    holds engines, split between the agents by rollout cost in whole ``engine_tp`` engines."""
    train, decode = [w.spec.num_parameters() for w in works], rollout_costs(works, a)
    n, g = cluster.nodes, cluster.gpus_per_node
    out: dict[tuple, Placement] = {}
    for engine_nodes in range(n):
        try:
            gpus = partition(train, Cluster(n - engine_nodes, g, cluster.gpu_memory_gib, cluster.gpu))
        except PlanError:
            continue
        trainers = place_trainers(gpus, n, g)
        slots = engine_slots(free_gpus(trainers, n, g), engine_tp)
        if slots < len(works):
            continue
        engines = place_engines(split_engines(decode, slots), engine_tp, trainers, n, g)
        out.setdefault((tuple(gpus), tuple(map(len, engines))),
                       Placement(tuple(gpus), tuple(trainers), tuple(engines), False))
    return list(out.values())


def _placements(works: list[AgentWork], cluster: Cluster, choice: Rollout | None,
                a: Assumptions) -> list[Placement]:
    costs = [w.spec.num_parameters() for w in works]
    if choice is None:  # in-process engines: the trainers share the whole cluster
        return _one_node(costs, cluster, True) if cluster.nodes == 1 else [_whole(costs, cluster)]
    if cluster.nodes == 1:
        return _one_node(costs, cluster, choice.colocation != "separate", choice.engine_tp)
    return multi_node_placements(works, cluster, choice.engine_tp, a)


def _whole(costs: list[float], cluster: Cluster) -> Placement:
    gpus = partition(costs, cluster)
    trainers = place_trainers(gpus, cluster.nodes, cluster.gpus_per_node)
    return Placement(tuple(gpus), tuple(trainers), ((),) * len(gpus), True)


@functools.lru_cache(maxsize=4096)
def _best_cached(a: AgentWork, gpus: int, cluster: Cluster, choice: Rollout | None, assumptions: Assumptions,
                 engine_gpus: int | None) -> tuple[AgentPlan | None, AgentPlan | None]:
    return _best(a, gpus, cluster, choice, assumptions, engine_gpus)


def _engine_limit(works: list[AgentWork], cluster: Cluster, choices: list[Rollout]) -> None:
    """Refuse up front when an agent's engine fits at no TP within a node (an engine never spans
    nodes), naming the limit: its bf16 weights per GPU at the largest TP against the engine's share."""
    for w in works:
        fitting = [c for c in choices if w.spec.num_heads % c.engine_tp == 0 and
                   engine_memory(w.spec, c.engine_tp, c.fraction, cluster.gpu_memory_gib).kv_tokens
                   >= w.tokens.prompt_len + w.tokens.max_response_len]
        if fitting or not choices:
            continue
        c = max(choices, key=lambda c: (c.engine_tp, c.fraction))
        e = engine_memory(w.spec, c.engine_tp, c.fraction, cluster.gpu_memory_gib)
        context = w.tokens.prompt_len + w.tokens.max_response_len
        over = (f"more than a GPU's {cluster.gpu_memory_gib:g} GiB" if e.weights > cluster.gpu_memory_gib * GIB else
                f"which with {ENGINE_RUNTIME_GIB:g} GiB of runtime and the KV cache of one {context}-token sequence "
                f"exceeds an engine's share of {e.share / GIB:.1f} GiB ({c.fraction:g} x {cluster.gpu_memory_gib:g})")
        raise PlanError(f"agent {w.name!r}: no rollout engine fits on one node: {w.spec.num_parameters() * 2 / GIB:.0f} "
                        f"GiB of bf16 weights are {e.weights / GIB:.1f} GiB per GPU at TP{c.engine_tp}, the largest "
                        f"engine TP on a {cluster.gpus_per_node}-GPU node, {over}; an engine never spans nodes")


def _objective(cfg: ExperimentConfig) -> str:
    """``sync``, or the overlapping ``train.rollout_mode`` the config runs (``one_step_off``, ``async``)."""
    return getattr(cfg.train, "rollout_mode", "sync") or "sync"


def plan_experiment(cfg: ExperimentConfig, cluster: Cluster, preset: dict, assumptions: Assumptions = Assumptions(),
                    *, colocate: bool | None = None, objective: str | None = None,
                    logprob_impl: str = "auto") -> ExperimentPlan:
    """Search every agent's layout at once (module docstring of :mod:`.search`) over the candidate
    placements, keeping the shortest step of ``objective`` (``sync``: :func:`~.timing.step_seconds`;
    ``one_step_off``/``async``: :func:`~.timing.overlapped_step_seconds`; default: the config's
    rollout mode). ``colocate``: engines on the trainers' GPUs (default: on one node when the mode
    is ``sync``; never on several nodes). ``logprob_impl``: the trainers' log-prob path (memory of
    the last stage, agents/logprob_path.py). Raises :class:`PlanError` naming the agent (or the
    cluster) when nothing fits."""
    objective = objective or _objective(cfg)
    if objective not in MODES:
        raise PlanError(f"train.rollout_mode={objective!r}: must be one of {list(MODES)}")
    works, sources = agent_works(cfg, logprob_impl)
    if colocate is None:
        colocate = cluster.nodes == 1 and objective == "sync"
    if colocate and cluster.nodes > 1:
        raise PlanError(f"cluster: {cluster.nodes} nodes: engines colocate only on one node (rollout.colocate)")
    colocation = HACRL_COLOCATION if colocate else "separate"
    sglang = cfg.rollout.engine == "sglang"
    choices = rollout_choices(cluster, [w.spec for w in works], colocation, "auto") if sglang else [None]
    if sglang:
        _engine_limit(works, cluster, choices)
    verify_s = verify_seconds(works[0].tokens, cfg.train.verifier_workers, assumptions)
    retokenize_s = retokenize_seconds(cross_responses(cfg, works), works[0].tokens, assumptions)
    best = _search(works, cluster, choices, assumptions, (verify_s, retokenize_s), objective)
    _, choice, place, plans = best
    step = _step(plans, (verify_s, retokenize_s), overlapping=choice is not None and not place.colocated)
    step.update(_run_terms(cfg, works, plans, step, assumptions, cluster))
    overrides = _overrides(cfg, plans, choice, place, cluster)
    notes = [f"schedule: {SCHEDULE}"]
    if choice is not None and cluster.nodes > 1:
        notes.append("engines run on the GPUs the placement lists per agent (job-wide rollout_gpu_ids); every "
                     "node, the controller's (node 0) included, offers all of its GPUs to Ray")
    text = _preset_yaml(preset, overrides)
    return ExperimentPlan(tuple(plans), choice, cluster, assumptions, step, tuple(overrides), text, tuple(sources),
                          tuple(notes), place, objective)


def _search(works: list[AgentWork], cluster: Cluster, choices: list[Rollout | None], assumptions: Assumptions,
            controller: tuple[float, float], objective: str) -> tuple[float, Rollout | None, Placement, list[AgentPlan]]:
    """The fastest (step of ``objective``, rollout choice, placement, agent plans) over every choice
    and candidate placement; raises :class:`PlanError` for the first agent that never fits."""
    best, closest, fit_any = None, [None] * len(works), [False] * len(works)
    trainer_gpus = None
    for choice in choices:
        for place in _placements(works, cluster, choice, assumptions):
            trainer_gpus = trainer_gpus or place.trainer_gpus
            plans = []
            for i, a in enumerate(works):
                engine_gpus = None if place.colocated else place.engine_gpus(i)
                p, near = _best_cached(a, place.trainer_gpus[i], cluster, choice, assumptions, engine_gpus)
                fit_any[i] |= p is not None
                if near is not None and (closest[i] is None
                                         or shortfall(near, cluster) < shortfall(closest[i], cluster)):
                    closest[i] = near
                plans.append(p)
            if all(plans):
                stages = step_seconds([p.times for p in plans], *controller)
                key = stages["total_s"] if objective == "sync" else overlapped_step_seconds(stages)
                if best is None or key < best[0]:
                    best = (key, choice, place, plans)
    if best is None:
        for i, a in enumerate(works):
            if not fit_any[i]:
                raise PlanError(_no_fit(a, (trainer_gpus or (0,) * len(works))[i], cluster, closest[i]))
        raise PlanError("cluster: every agent fits alone, but no engine TP / memory fraction fits all agents at once "
                        "(the config holds one rollout.sglang.tp and rollout.sglang.mem_fraction)")
    return best


def _best(a: AgentWork, gpus: int, cluster: Cluster, choice: Rollout | None, assumptions: Assumptions,
          engine_gpus: int | None) -> tuple[AgentPlan | None, AgentPlan | None]:
    if choice is not None:
        return best_for_agent(a, gpus, cluster, choice, assumptions, engine_gpus)
    from hacrl_megatron.plan.search import layouts

    cands = [evaluate(a, lay, cluster, None, gpus=gpus)
             for lay in layouts(a.spec, gpus, cluster, a.routing_replay, a.cp)]
    fits = [p for p in cands if p.fits]
    key = lambda p: (p.seconds, p.peak.total)  # noqa: E731
    return (min(fits, key=key) if fits else None), (min(cands, key=lambda p: shortfall(p, cluster)) if cands else None)


def _step(plans: list[AgentPlan], controller: tuple[float, float], overlapping: bool) -> dict:
    """The step under the loop's schedule: its stages, ``total_s``, the previous loop's
    ``sequential_s``, the overlapped ``one_step_off_s`` / ``async_s`` (None when the engines share
    the trainers' GPUs and so cannot generate while they train) and the GSPO×2 comparison.
    ``controller``: the controller's (verify, re-tokenisation) seconds."""
    times = [p.times for p in plans]
    step = step_seconds(times, *controller)
    step["sequential_s"] = sequential_step_seconds(times, *controller)
    overlapped = overlapped_step_seconds(step) if overlapping else None
    step["one_step_off_s"] = step["async_s"] = overlapped
    gspo = step_seconds([{**t, "rollout_s": t.get("gspo_x2_rollout_s", 0.0)} for t in times], *controller)
    step["gspo_x2_rollout_s"], step["gspo_x2_total_s"] = gspo["rollout_s"], gspo["total_s"]
    step["hacpo_rollout_saving_s"] = gspo["rollout_s"] - step["rollout_s"]
    step["separate_jobs"] = separate_jobs_seconds({p.name: p.times for p in plans}, *controller)
    return step


def _run_terms(cfg: ExperimentConfig, works: list[AgentWork], plans: list[AgentPlan], step: dict,
               a: Assumptions, cluster: Cluster) -> dict:
    """What a whole run adds to its steps: ``checkpoint_s`` (one checkpoint's write), ``checkpoint_async``
    (``checkpoint.async_save``; unset means true here: plans are for GPUs), ``checkpoint_wait_s`` (what
    one save holds the loop, :func:`~.timing.checkpoint_wait_seconds`; the saves are
    ``checkpoint.every`` steps of ``total_s`` apart), ``checkpoint_snapshot_s`` (its copy to host
    memory), ``checkpoint_host_gib`` (host memory of one node's copies, an upper bound: every GPU of
    the node holding the largest share), ``checkpoints`` (how many), ``export_s`` (the final
    HF export) and ``run_s`` (``train.steps`` synchronous steps, every save's wait, the last
    asynchronous save's write, finished at the end, and the export; evaluation not counted)."""
    params = [w.spec.num_parameters() for w in works]
    ckpt, export = checkpoint_seconds(params, a), export_seconds(params, a)
    count = checkpoints_per_run(cfg.train.steps, cfg.checkpoint.every)
    asynchronous = cfg.checkpoint.async_save is not False
    largest = max(checkpoint_rank_bytes(max(rank_params(p.spec, p.layout.tp, p.layout.pp, ep=p.layout.ep,
                                                        etp=p.layout.etp).per_stage),
                                        p.layout.dp if p.layout.distributed_optimizer else 1, a) for p in plans)
    snapshot = snapshot_seconds(largest, a)
    interval = max(1, cfg.checkpoint.every) * step["total_s"]
    wait = checkpoint_wait_seconds(ckpt, snapshot, interval, asynchronous)
    host = largest * min(cluster.gpus_per_node, max(p.trainer_gpus for p in plans))
    tail = ckpt if asynchronous and count else 0.0
    return {"checkpoint_s": ckpt, "checkpoint_async": asynchronous, "checkpoint_wait_s": wait,
            "checkpoint_snapshot_s": snapshot, "checkpoint_host_gib": host / 2**30, "checkpoints": count,
            "export_s": export, "run_s": cfg.train.steps * step["total_s"] + count * wait + tail + export}


def _no_fit(a: AgentWork, gpus: int, cluster: Cluster, near: AgentPlan | None) -> str:
    where = f"its {gpus} GPU(s) of {cluster.gpu_memory_gib:g} GiB"
    if near is None:
        return f"agent {a.name!r}: no layout divides its model on {where} (tp within a node must divide the heads)"
    lay = near.layout
    why = "; ".join(r.split(": ", 1)[1] for r in near.reasons) or "does not fit"
    cp = f" cp={lay.cp}" if lay.cp > 1 else ""
    return (f"agent {a.name!r}: no layout fits on {where} (cluster too small); closest tp={lay.tp} pp={lay.pp}{cp} "
            f"dp={lay.dp} recompute={lay.recompute}: {why}")


def _overrides(cfg: ExperimentConfig, plans: list[AgentPlan], choice: Rollout | None, place: Placement,
               cluster: Cluster) -> list[str]:
    """Dotted overrides that turn ``cfg`` into the plan. Engine GPUs (``rollout_gpu_ids``): on one
    node local ids; on several, job-wide indices ``node · gpus_per_node + local id``."""
    out = []
    for i, (agent, p) in enumerate(zip(cfg.agents, plans)):
        lay = p.layout
        out += [f"agents.{i}.parallel.tp={lay.tp}", f"agents.{i}.parallel.pp={lay.pp}",
                f"agents.{i}.parallel.dp={lay.dp}",
                f"agents.{i}.parallel.sequence_parallel={str(lay.sequence_parallel).lower()}",
                f"agents.{i}.parallel.use_distributed_optimizer={str(lay.distributed_optimizer).lower()}",
                f"agents.{i}.parallel.recompute={lay.recompute}"]
        if p.spec.is_moe:
            out += [f"agents.{i}.parallel.ep={lay.ep}", f"agents.{i}.parallel.etp={lay.etp}"]
        if lay.cp > 1:
            out.append(f"agents.{i}.parallel.cp={lay.cp}")
        if agent.workers == "local" and lay.gpus > 1:
            out.append(f"agents.{i}.workers=auto")
        if choice is not None:
            if place.colocated:
                first = place.trainers[i][0][1]
                ids = list(range(first, first + p.engines * choice.engine_tp))
            else:
                ids = [g for e in place.engines[i] for g in e.job_ids(cluster.gpus_per_node)]
            out.append(f"agents.{i}.rollout_gpu_ids=[{', '.join(map(str, ids))}]")
    if choice is not None:
        out += [f"rollout.sglang.tp={choice.engine_tp}", f"rollout.sglang.mem_fraction={choice.fraction:g}",
                f"rollout.colocate={str(choice.colocation != 'separate').lower()}",
                f"rollout.weight_sync={choice.transport}"]
    return out


def _preset_yaml(preset: dict, overrides: list[str]) -> str:
    """The preset with the overrides applied, validated like ``hacrl train`` would."""
    data = copy.deepcopy(preset)
    for ov in overrides:
        apply_override(data, ov)
    try:
        validate(from_dict(ExperimentConfig, data))
    except ConfigError as err:
        raise PlanError(f"planned config does not validate: {err}") from None
    return yaml.safe_dump(data, sort_keys=False)
