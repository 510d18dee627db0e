"""Plan a whole experiment config on a cluster: every agent's layout, engines and config overrides.

The result carries the overrides (dotted ``key=value``) and a self-contained preset YAML; both are
validated with :func:`hacrl_megatron.config.load_config`'s rules before they are returned, so
``hacrl train`` / ``hacrl launch`` accept them unchanged.
"""

from __future__ import annotations

import copy
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
from hacrl_megatron.models.provider import ArchSpec, UnsupportedModelError
from hacrl_megatron.plan.known_models import KNOWN_CONFIGS
from hacrl_megatron.plan.memory import Workload
from hacrl_megatron.plan.params import arch_from_config
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
from hacrl_megatron.plan.timing import Assumptions, Tokens


@dataclass(frozen=True)
class ExperimentPlan:
    """The chosen layout of every agent and what the step costs."""

    agents: tuple[AgentPlan, ...]
    rollout: Rollout | None
    cluster: Cluster
    assumptions: Assumptions
    step: dict  # rollout_s, train_s, sync_s, total_s (+ GSPO×2 rollout for comparison)
    overrides: tuple[str, ...]
    preset_yaml: str
    sources: tuple[str, ...]  # where each agent's architecture came from
    notes: tuple[str, ...]
    placement: Placement


def agent_spec(agent: AgentConfig) -> tuple[ArchSpec, str]:
    """The agent's :class:`ArchSpec` without weights: ``model.hf_path``'s config.json, else the
    built-in copy of a known model's config (folder not downloaded yet), else the model sizes."""
    m = agent.model
    if m.hf_path:
        path = os.path.join(m.hf_path, "config.json")
        name = os.path.basename(os.path.normpath(m.hf_path))
        try:
            if os.path.isfile(path):
                return _with_dtype(arch_from_config(path), m.dtype), path
            if name in KNOWN_CONFIGS:
                return _with_dtype(arch_from_config(KNOWN_CONFIGS[name]), m.dtype), f"built-in config of {name}"
        except UnsupportedModelError as err:
            raise PlanError(f"agent {agent.name!r}: {err}") from None
        raise PlanError(f"agent {agent.name!r}: model.hf_path={m.hf_path!r} has no config.json and is not a known "
                        f"model ({sorted(KNOWN_CONFIGS)})")
    from hacrl_megatron.exchange.tokenizers import load_tokenizer
    from hacrl_megatron.models.provider import arch_from_model_config

    vocab = m.vocab_size or len(load_tokenizer(agent.tokenizer))
    return arch_from_model_config(m, vocab), f"model sizes in the config (vocab {vocab} from the tokenizer)"


def _with_dtype(spec: ArchSpec, dtype: str) -> ArchSpec:
    import dataclasses

    return dataclasses.replace(spec, dtype=dtype)


def agent_works(cfg: ExperimentConfig) -> tuple[list[AgentWork], list[str]]:
    """Each agent's :class:`AgentWork` from the config (micro-batches padded to the longest sequence)."""
    r, t = cfg.rollout, cfg.train
    tokens = Tokens(prompts=t.prompts_per_step, samples=r.samples_per_prompt, agents=len(cfg.agents),
                    prompt_len=r.max_prompt_len, max_response_len=r.max_response_len, updates=t.mini_batches,
                    micro_batch=t.micro_batch_size)
    works, sources = [], []
    for agent in cfg.agents:
        spec, source = agent_spec(agent)
        micro = max(1, tokens.trained_sequences // (t.mini_batches * t.micro_batch_size))
        work = Workload(seq_len=r.max_prompt_len + r.max_response_len, micro_batch=t.micro_batch_size,
                        microbatches=micro)
        works.append(AgentWork(agent.name, spec, work, tokens))
        sources.append(f"{agent.name}: {source}")
    return works, sources


@dataclass(frozen=True)
class Placement:
    """GPUs of every agent: its trainer's count and its engines' GPU ids on the controller's node."""

    trainer_gpus: tuple[int, ...]
    engine_gpus: tuple[int, ...]
    engine_first_id: tuple[int, ...]  # first engine GPU id on the controller's node, per agent
    trainer_first_node: tuple[int, ...]


def placement(costs: list[float], cluster: Cluster) -> Placement:
    """Where each agent runs. Our SGLang servers are subprocesses of the controller (``hacrl
    train`` on the first node, reached at 127.0.0.1), so engines live on that node: one node →
    colocated engines on each agent's own GPUs; several nodes → the first node holds every
    agent's engines (split in proportion to cost) and the trainers share the other nodes."""
    n = len(costs)
    if cluster.nodes == 1:
        gpus = partition(costs, cluster)
        first = [sum(gpus[:i]) for i in range(n)]
        return Placement(tuple(gpus), tuple(gpus), tuple(first), (0,) * n)
    engine_node = Cluster(1, cluster.gpus_per_node, cluster.gpu_memory_gib, cluster.gpu)
    engines = partition(costs, engine_node)
    trainers = partition(costs, Cluster(cluster.nodes - 1, cluster.gpus_per_node, cluster.gpu_memory_gib, cluster.gpu))
    first_node = [1 + sum(trainers[:i]) // cluster.gpus_per_node for i in range(n)]
    return Placement(tuple(trainers), tuple(engines), tuple(sum(engines[:i]) for i in range(n)), tuple(first_node))


def plan_experiment(cfg: ExperimentConfig, cluster: Cluster, preset: dict,
                    assumptions: Assumptions = Assumptions()) -> ExperimentPlan:
    """Search every agent's layout at once (module docstring of :mod:`.search`) within
    :func:`placement`; raises :class:`PlanError` naming the agent (or the cluster) when nothing fits."""
    works, sources = agent_works(cfg)
    colocation = HACRL_COLOCATION if cluster.nodes == 1 else "separate"
    place = placement([w.spec.num_parameters() for w in works], cluster)
    sglang = cfg.rollout.engine == "sglang"
    choices = rollout_choices(cluster, [w.spec for w in works], colocation, "auto") if sglang else [None]
    best, closest = None, [None] * len(works)
    fit_any = [False] * len(works)
    for choice in choices:
        plans = []
        for i, a in enumerate(works):
            engine_gpus = place.engine_gpus[i] if colocation == "separate" else None
            p, near = _best(a, place.trainer_gpus[i], cluster, choice, assumptions, engine_gpus)
            fit_any[i] |= p is not None
            if near is not None and (closest[i] is None
                                     or shortfall(near, cluster) < shortfall(closest[i], cluster)):
                closest[i] = near
            plans.append(p)
        if all(plans):
            step = _step(plans)
            if best is None or step["total_s"] < best[2]["total_s"]:
                best = (choice, plans, step)
    if best is None:
        for i, a in enumerate(works):
            if not fit_any[i]:
                raise PlanError(_no_fit(a, place.trainer_gpus[i], cluster, closest[i]))
        raise PlanError("cluster: every agent fits alone, but no engine TP / memory fraction fits all agents at once "
                        "(the config holds one rollout.sglang.tp and rollout.sglang.mem_fraction)")
    choice, plans, step = best
    overrides = _overrides(cfg, plans, choice, place)
    notes = []
    if cluster.nodes > 1 and sglang:
        notes.append(f"engines run on the first node (the controller's), trainers on nodes 1-{cluster.nodes - 1}; "
                     "hacrl launch --executor slurm withholds the first node's GPUs from Ray when --nodes > 1")
    text = _preset_yaml(preset, overrides)
    return ExperimentPlan(tuple(plans), choice, cluster, assumptions, step, tuple(overrides), text, tuple(sources),
                          tuple(notes), place)


def _best(a: AgentWork, gpus: int, cluster: Cluster, choice: Rollout | None, assumptions: Assumptions,
          engine_gpus: int | None) -> tuple[AgentPlan | None, AgentPlan | None]:
    if choice is not None:
        return best_for_agent(a, gpus, cluster, choice, assumptions, engine_gpus)
    from hacrl_megatron.plan.search import layouts

    cands = [evaluate(a, lay, cluster, None, gpus=gpus) for lay in layouts(a.spec, gpus, cluster)]
    fits = [p for p in cands if p.fits]
    key = lambda p: (p.seconds, p.peak.total)  # noqa: E731
    return (min(fits, key=key) if fits else None), (min(cands, key=lambda p: shortfall(p, cluster)) if cands else None)


def _step(plans: list[AgentPlan]) -> dict:
    step = {k: max(p.times.get(k, 0.0) for p in plans) for k in ("rollout_s", "train_s", "sync_s", "gspo_x2_rollout_s")}
    step["total_s"] = step["rollout_s"] + step["train_s"] + step["sync_s"]
    step["gspo_x2_total_s"] = step["gspo_x2_rollout_s"] + step["train_s"] + step["sync_s"]
    step["hacpo_rollout_saving_s"] = step["gspo_x2_rollout_s"] - step["rollout_s"]
    return step


def _no_fit(a: AgentWork, gpus: int, cluster: Cluster, near: AgentPlan | None) -> str:
    where = f"its {gpus} GPU(s) of {cluster.gpu_memory_gib:g} GiB"
    if near is None:
        return f"agent {a.name!r}: no layout divides its model on {where} (tp within a node must divide the heads)"
    lay = near.layout
    why = "; ".join(r.split(": ", 1)[1] for r in near.reasons) or "does not fit"
    return (f"agent {a.name!r}: no layout fits on {where} (cluster too small); closest tp={lay.tp} pp={lay.pp} "
            f"dp={lay.dp} recompute={lay.recompute}: {why}")


def _overrides(cfg: ExperimentConfig, plans: list[AgentPlan], choice: Rollout | None, place: Placement) -> list[str]:
    """Dotted overrides that turn ``cfg`` into the plan (engine GPU ids on the controller's node)."""
    out = []
    for i, (agent, p) in enumerate(zip(cfg.agents, plans)):
        lay = p.layout
        out += [f"agents.{i}.parallel.tp={lay.tp}", f"agents.{i}.parallel.pp={lay.pp}",
                f"agents.{i}.parallel.dp={lay.dp}",
                f"agents.{i}.parallel.sequence_parallel={str(lay.sequence_parallel).lower()}",
                f"agents.{i}.parallel.use_distributed_optimizer={str(lay.distributed_optimizer).lower()}",
                f"agents.{i}.parallel.recompute={lay.recompute}"]
        if agent.workers == "local" and lay.gpus > 1:
            out.append(f"agents.{i}.workers=auto")
        if choice is not None:
            first = place.engine_first_id[i]
            ids = range(first, first + p.engines * choice.engine_tp)
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
