"""``hacrl plan``: will this layout fit, what does a step cost, how do the agents share the cluster.

    hacrl plan --preset P [overrides] --nodes N --gpus-per-node G --gpu-memory-gib M [--gpu h100] [--json]
    hacrl plan --model DIR_OR_CONFIG_JSON --tp T --pp P --dp D [--cp C] --gpu-memory-gib M [--recompute full]
               [--no-dist-opt] [--rollout-mem-fraction F] [--json]
    either: [--logprob-impl auto|reference|triton|megatron] (the trainers' log-prob path, default auto)

The first searches every agent's layout at once and prints them with the overrides (and a preset
YAML) that ``hacrl train`` / ``hacrl launch`` accept unchanged. The second evaluates one layout of
one model (full recompute and the distributed optimizer unless told otherwise; only the trainer's
memory unless ``--rollout-mem-fraction`` puts a colocated engine on the same GPUs). Exit status:
0 with a plan (fitting or not), 2 for bad input (unknown GPU, a layout that cannot divide the
model, a cluster too small for any layout), with one line naming the agent and the constraint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from hacrl_megatron.agents.logprob_path import LOGPROB_IMPLS
from hacrl_megatron.plan.memory import COLOCATION

MAX_NODES = 256  # the layout search's time grows with the nodes it splits between trainers and engines
MAX_GPUS_PER_NODE = 128


def add_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--preset", help="plan a whole experiment: built-in preset name or YAML path")
    what.add_argument("--model", help="evaluate one layout of one model: HF folder or its config.json")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides (with --preset)")
    p.add_argument("--gpu-memory-gib", type=float, required=True, help="memory per GPU in GiB (80 GB = 74.5 GiB)")
    p.add_argument("--gpu", default="h100", help="a100 | h100 | h200 | b200: peak TFLOP/s and HBM GB/s (default h100)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--logprob-impl", choices=LOGPROB_IMPLS, default="auto",
                   help="the trainers' log-prob path: auto | reference | triton (our fused kernel, no logits, "
                   "also under sequence parallelism) or megatron (materialised logits on the last stage); "
                   "default auto, as hacrl train")
    c = p.add_argument_group("--preset: the cluster")
    c.add_argument("--nodes", type=int, help="nodes in the cluster")
    c.add_argument("--gpus-per-node", type=int, help="GPUs per node")
    m = p.add_argument_group("--model: the layout and workload")
    m.add_argument("--tp", type=int, help="tensor-parallel size")
    m.add_argument("--pp", type=int, help="pipeline-parallel size")
    m.add_argument("--dp", type=int, help="data-parallel size")
    m.add_argument("--cp", type=int, default=1, help="context-parallel size: each sequence split over cp ranks "
                   "(Transformer Engine's ring attention; GPUs = tp·pp·cp·dp; default 1)")
    m.add_argument("--ep", type=int, default=1, help="MoE: expert-parallel size (ep·etp must divide tp·cp·dp)")
    m.add_argument("--etp", type=int, default=None, help="MoE: expert tensor-parallel size (default: tp when "
                   "--ep is 1, else 1)")
    m.add_argument("--recompute", choices=("none", "selective", "full"), default="full",
                   help="activation recompute (default full)")
    m.add_argument("--no-dist-opt", action="store_true", help="no distributed optimizer (12 B/param on every rank)")
    m.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (tp > 1)")
    m.add_argument("--grad-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="main-gradient dtype (ours: float32; NeMo-RL's default reduces in bf16)")
    m.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (prompt + response; default 4096, or the model's positions if fewer)")
    m.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    m.add_argument("--global-batch", type=int, default=512, help="sequences per optimizer update")
    m.add_argument("--rollout-mem-fraction", type=float, default=None,
                   help="a colocated engine keeps this share of each GPU (default: no engine counted)")
    m.add_argument("--engine-tp", type=int, default=None, help="colocated engine TP (default: --tp)")
    m.add_argument("--colocation", choices=[c for c in COLOCATION if c != "separate"], default="release",
                   help="what the engine and trainer free for each other (default release: ours)")


class _BadInput(ValueError):
    pass


def _logprob_impl(args: argparse.Namespace) -> str:
    """``--logprob-impl``; "auto" (the trainer's default) for a Namespace built without it (tools, tests)."""
    return getattr(args, "logprob_impl", "auto")


def _cluster(args: argparse.Namespace, nodes: int, gpn: int) -> Any:
    from hacrl_megatron.plan.gpus import gpu_by_name
    from hacrl_megatron.plan.search import Cluster

    if not (math.isfinite(args.gpu_memory_gib) and args.gpu_memory_gib > 0):
        raise _BadInput(f"--gpu-memory-gib={args.gpu_memory_gib:g}: must be a finite number > 0")
    return Cluster(nodes, gpn, args.gpu_memory_gib, gpu_by_name(args.gpu))


def _experiment(args: argparse.Namespace) -> dict[str, Any]:
    from hacrl_megatron.config import ExperimentConfig, apply_override, from_dict, read_preset, validate
    from hacrl_megatron.plan.experiment import plan_experiment
    from hacrl_megatron.plan.report import agent_dict, assumptions_dict, placement_dict, step_fields

    for name, most in (("nodes", MAX_NODES), ("gpus_per_node", MAX_GPUS_PER_NODE)):
        value = getattr(args, name)
        if value is None or value < 1:
            raise _BadInput(f"--preset needs --{name.replace('_', '-')} >= 1 (got {value})")
        if value > most:  # the search tries every split of the nodes: its time grows with them
            raise _BadInput(f"--{name.replace('_', '-')}={value}: at most {most} (plan a part of a larger cluster)")
    cluster = _cluster(args, args.nodes, args.gpus_per_node)
    data = read_preset(args.preset)
    for ov in args.overrides:
        apply_override(data, ov)
    cfg = validate(from_dict(ExperimentConfig, data))
    plan = plan_experiment(cfg, cluster, data, logprob_impl=_logprob_impl(args))
    agents = [agent_dict(p, src.split(": ", 1)[1]) for p, src in zip(plan.agents, plan.sources)]
    out = {"mode": "experiment", "preset": args.preset, "agents": agents,
           "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                       "gpu_memory_gib": cluster.gpu_memory_gib},
           "rollout": None if plan.rollout is None else vars(plan.rollout),
           **step_fields(plan), "placement": placement_dict(plan),
           "assumptions": assumptions_dict(plan.assumptions, cluster), "notes": list(plan.notes),
           "overrides": list(plan.overrides), "preset_yaml": plan.preset_yaml}
    if plan.rollout is not None and plan.placement.colocated:
        out["overlap_plan"] = _overlap_plan(cfg, cluster, data, _logprob_impl(args))
        out["step_time_one_step_off_s"] = out["step_time_async_s"] = out["overlap_plan"].get("step_time_s")
    return out


def _overlap_plan(cfg: Any, cluster: Any, data: dict, logprob_impl: str = "auto") -> dict[str, Any]:
    """Colocated engines cannot generate while their trainer trains: the best plan with engines on
    GPUs of their own for ``train.rollout_mode: one_step_off`` / ``async`` (or why there is none)."""
    from hacrl_megatron.plan.experiment import plan_experiment
    from hacrl_megatron.plan.report import placement_dict, step_fields
    from hacrl_megatron.plan.search import PlanError

    try:
        alt = plan_experiment(cfg, cluster, data, colocate=False, objective="one_step_off",
                              logprob_impl=logprob_impl)
    except PlanError as err:
        return {"step_time_s": None, "why": str(err)}
    fields = step_fields(alt)
    return {"step_time_s": fields["step_time_one_step_off_s"], "synchronous_step_time_s": fields["step_time_s"],
            "step_stages_s": fields["step_stages_s"], "placement": placement_dict(alt),
            "layouts": [{"name": p.name, "tp": p.layout.tp, "pp": p.layout.pp, "dp": p.layout.dp,
                         "recompute": p.layout.recompute, "trainer_gpus": p.trainer_gpus,
                         "engine_gpus": p.engine_gpus} for p in alt.agents],
            "overrides": list(alt.overrides)}


def _model(args: argparse.Namespace) -> dict[str, Any]:
    from hacrl_megatron.plan.memory import Layout, Workload
    from hacrl_megatron.plan.params import arch_from_config
    from hacrl_megatron.plan.report import agent_dict, assumptions_dict
    from hacrl_megatron.plan.search import AgentWork, Rollout, evaluate
    from hacrl_megatron.plan.timing import Assumptions, Tokens

    for name in ("tp", "pp", "dp", "cp"):
        value = getattr(args, name, 1)  # cp: 1 for a Namespace built without it (tools, tests)
        if value is None or value < 1:
            raise _BadInput(f"--model needs --{name} >= 1 (got {value})")
    cp = getattr(args, "cp", 1)
    if args.overrides:
        raise _BadInput(f"overrides {args.overrides} need --preset (--model takes a layout, not a config)")
    for name, least in (("seq_len", 4), ("micro_batch_size", 1), ("global_batch", 1), ("engine_tp", 1)):
        value = getattr(args, name)  # a prompt and a response of >= 1 token each; 0 divided later
        if value is not None and value < least:
            raise _BadInput(f"--{name.replace('_', '-')}={value}: must be >= {least}")
    name = os.path.basename(os.path.normpath(os.path.dirname(args.model) if args.model.endswith(".json")
                                             else args.model)) or "model"
    spec = arch_from_config(args.model)
    if args.seq_len is None:  # the default follows a model with fewer positions; a value given is checked
        args.seq_len = min(4096, spec.max_position_embeddings)
    if args.seq_len > spec.max_position_embeddings:  # positions past the model's own cannot be planned for it
        raise _BadInput(f"--seq-len={args.seq_len}: model {name!r} has {spec.max_position_embeddings} positions "
                        "(max_position_embeddings); a sequence may not be longer")
    if args.sequence_parallel and args.tp < 2:
        raise _BadInput(f"model {name!r}: --sequence-parallel needs --tp > 1 (got {args.tp})")
    gpus_per_node = max(8, args.tp)
    cluster = _cluster(args, 1, gpus_per_node)
    ep = args.ep if spec.is_moe else 1
    etp = (args.etp or (args.tp if ep == 1 else 1)) if spec.is_moe else 1
    if not spec.is_moe and (args.ep != 1 or args.etp not in (None, 1)):
        raise _BadInput(f"model {name!r}: --ep/--etp need a Mixture-of-Experts model, {spec.arch} is dense")
    try:
        layout = Layout(args.tp, args.pp, args.dp, args.sequence_parallel, args.recompute, not args.no_dist_opt,
                        args.grad_dtype, ep=ep, etp=etp, cp=cp)
    except ValueError as err:
        raise _BadInput(f"model {name!r}: {err}") from None
    micro = max(1, args.global_batch // args.micro_batch_size)
    work = Workload(seq_len=args.seq_len, micro_batch=args.micro_batch_size, microbatches=micro,
                    logprob_impl=_logprob_impl(args))
    tokens = Tokens(prompts=args.global_batch, samples=1, agents=1, prompt_len=args.seq_len // 4,
                    max_response_len=args.seq_len - args.seq_len // 4, updates=1, micro_batch=args.micro_batch_size)
    rollout = None
    if args.rollout_mem_fraction is not None:
        if not 0 < args.rollout_mem_fraction < 1:
            raise _BadInput(f"--rollout-mem-fraction={args.rollout_mem_fraction:g}: must lie in (0, 1)")
        rollout = Rollout(args.colocation, args.engine_tp or args.tp, args.rollout_mem_fraction, "tensor")
    plan = evaluate(AgentWork(name, spec, work, tokens), layout, cluster, rollout)
    return {"mode": "model", "model": args.model, "agents": [agent_dict(plan, args.model)],
            "workload": {"seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
                         "global_batch": args.global_batch, "grad_dtype": args.grad_dtype,
                         "logprob_impl": _logprob_impl(args)},
            "assumptions": assumptions_dict(Assumptions(), cluster)}


def main(args: argparse.Namespace) -> int:
    from hacrl_megatron.models.provider import ParallelLayoutError, UnsupportedModelError
    from hacrl_megatron.plan.gpus import UnknownGPUError
    from hacrl_megatron.plan.search import PlanError

    try:
        obj = _experiment(args) if args.preset else _model(args)
    except (PlanError, UnknownGPUError, _BadInput, ParallelLayoutError, UnsupportedModelError, FileNotFoundError,
            ValueError) as err:
        from hacrl_megatron.config import ConfigError

        if isinstance(err, ConfigError):
            raise
        print(f"hacrl plan: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(obj, indent=1))
    else:
        from hacrl_megatron.plan.report import render_text

        print(render_text(obj))
        if obj.get("preset_yaml"):
            print("\npreset YAML:\n" + obj["preset_yaml"], end="")
    return 0
