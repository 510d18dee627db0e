"""The rules of the large-scale step's layout keys: token budgets against the row geometry, megatron-core's
overlapped data parallelism, and context parallelism (docs/scaling.md). Each failure names field, value
and rule, as every rule of config/validation.py does."""

from __future__ import annotations

from typing import Any

from hacrl_megatron.accelerators import transformer_engine_available
from hacrl_megatron.config.bounded_yaml import short_repr
from hacrl_megatron.config.layout import geometry_for
from hacrl_megatron.config.schema import AgentConfig, ConfigError, ExperimentConfig


def _rule(ok: bool, path: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{path}={short_repr(value)}: {rule}")


def validate_data_parallel_overlap(agent_cfg: AgentConfig, path: str) -> None:
    """``parallel.overlap_grad_reduce``, ``overlap_param_gather`` and ``ddp_bucket_mb`` configure
    megatron-core's DDP wrapper (agents/ddp.py): Megatron agents only, and the parameter gather
    overlaps only the distributed optimizer's gather, together with the overlapped reduction."""
    p = agent_cfg.parallel
    megatron = agent_cfg.backend == "megatron"
    for name in ("overlap_grad_reduce", "overlap_param_gather"):
        _rule(megatron or not getattr(p, name), f"{path}.parallel.{name}", True,
              "configures megatron-core's data-parallel wrapper: needs backend: megatron")
    _rule(p.ddp_bucket_mb >= 0, f"{path}.parallel.ddp_bucket_mb", p.ddp_bucket_mb,
          "must be >= 0 (MiB of gradients per bucket; 0: megatron's default)")
    _rule(megatron or p.ddp_bucket_mb == 0, f"{path}.parallel.ddp_bucket_mb", p.ddp_bucket_mb,
          "configures megatron-core's data-parallel wrapper: needs backend: megatron")
    _rule(not p.overlap_param_gather or p.use_distributed_optimizer, f"{path}.parallel.overlap_param_gather", True,
          "overlaps the distributed optimizer's all-gather of updated shards: set "
          "parallel.use_distributed_optimizer: true")
    _rule(not p.overlap_param_gather or p.overlap_grad_reduce, f"{path}.parallel.overlap_param_gather", True,
          "megatron-core overlaps the parameter gather together with the gradient reduction: set "
          "parallel.overlap_grad_reduce: true")


def validate_context_parallel(agent_cfg: AgentConfig, path: str) -> None:
    """``parallel.cp``: each row split over cp ranks, attention inside Transformer Engine (megatron-core's
    ring exchange of keys and values, 'p2p': every rank keeps all heads of its chunk, so the heads need
    to divide by tp only; agents/context_parallel.py). Megatron agents with their own world of
    tp·pp·cp·dp ranks; MoE routing replay keeps its routes per full row and is refused with it. Whether
    the machine has Transformer Engine is checked where the ranks are built (:func:`require_context_parallel`),
    not here: a login node without GPUs validates configurations for the cluster."""
    p = agent_cfg.parallel
    _rule(p.cp >= 1, f"{path}.parallel.cp", p.cp, "must be >= 1")
    if p.cp == 1:
        return
    _rule(agent_cfg.backend == "megatron", f"{path}.parallel.cp", p.cp,
          "context parallelism runs in megatron-core's attention: needs backend: megatron")
    _rule(agent_cfg.workers != "local", f"{path}.parallel.cp", p.cp,
          f"an agent with cp={p.cp} needs its own world of tp·pp·cp·dp ranks: set workers: ray or auto")
    _rule(not agent_cfg.model.moe_routing_replay, f"{path}.model.moe_routing_replay", True,
          f"routing replay records each sequence's experts over its whole row; with parallel.cp={p.cp} every rank "
          "routes only its chunks of the row: set it to false (or cp: 1)")


def validate_row_geometry(cfg: ExperimentConfig) -> None:
    """With a token budget, the longest sequence a rollout can make, padded as each Megatron agent's
    rows pad it (sequence parallelism: a multiple of tp; context parallelism: of 2·cp, times tp under
    sequence parallelism), must fit the budget: a sequence is never split across micro-batches."""
    t, r = cfg.train, cfg.rollout
    if t.max_tokens_per_microbatch <= 0:
        return
    longest = r.max_prompt_len + r.max_response_len
    for agent_cfg in cfg.agents:
        if agent_cfg.backend != "megatron":
            continue
        p = agent_cfg.parallel
        geometry = geometry_for(t.pack_sequences, p.tp, p.sequence_parallel and p.tp > 1, p.cp)
        padded = geometry.tokens([longest])
        _rule(t.max_tokens_per_microbatch >= padded, "train.max_tokens_per_microbatch", t.max_tokens_per_microbatch,
              f"must hold the longest sequence as agent {agent_cfg.name!r} pads it: {longest} tokens "
              f"(rollout.max_prompt_len + max_response_len) become {padded} with tp={p.tp}, cp={p.cp}, "
              f"sequence_parallel={p.sequence_parallel}")


def require_context_parallel(cp: int, field: str) -> None:
    """Refuse ``cp > 1`` on a machine without Transformer Engine on CUDA: context parallelism splits
    attention over ranks inside TE's attention (the ring exchange of keys and values); megatron-core's
    local attention (the CPU layer spec) asserts cp = 1. Called where the agent's ranks are built (the
    trainer for in-process agents, each rank for Ray agents), never by the configuration rules, which a
    login node without GPUs checks for a cluster. ``field`` names the key in the one-line message."""
    if cp > 1 and not transformer_engine_available():
        raise ConfigError(f"{field}={cp}: context parallelism needs Transformer Engine's attention on a CUDA GPU, "
                          "and this machine has no CUDA device or no transformer_engine: set it to 1 here")
