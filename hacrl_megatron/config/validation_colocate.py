"""The rules of colocation (``rollout.colocate``: engines on the trainer's GPUs, docs/colocation.md): which
engines can share, how their weights arrive, what the trainer offloads, and, with ``rollout.sglang.placement:
ray``, the servers that follow an agent's Ray ranks onto every node they use. Each failure names field,
value and rule, as every rule of config/validation.py does."""

from __future__ import annotations

from typing import Any

from hacrl_megatron.config.bounded_yaml import short_repr
from hacrl_megatron.config.schema import COLOCATE_OFFLOAD, ConfigError, ExperimentConfig


def _rule(ok: bool, path: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{path}={short_repr(value)}: {rule}")


def validate_colocation(cfg: ExperimentConfig) -> None:
    """``rollout.colocate``, ``rollout.colocate_offload`` and what colocated servers need of
    ``rollout.weight_sync``, ``rollout.sglang.placement`` and each agent."""
    r = cfg.rollout
    _rule(r.colocate_offload in COLOCATE_OFFLOAD, "rollout.colocate_offload", r.colocate_offload,
          f"must be one of {list(COLOCATE_OFFLOAD)}")
    _rule(not r.colocate or r.engine in ("sglang", "vllm"), "rollout.colocate", r.colocate,
          "only SGLang and vLLM engines are separate servers that can share the trainer's GPUs "
          "(rollout.engine: sglang or vllm)")
    _rule(r.weight_sync != "tensor" or r.colocate, "rollout.weight_sync", r.weight_sync,
          "tensor (CUDA IPC) needs the servers on the trainer's GPUs: set rollout.colocate: true")
    _rule(r.weight_sync != "distributed" or not r.colocate, "rollout.weight_sync", r.weight_sync,
          "colocated servers share the trainer's GPUs and NCCL cannot put two ranks of one group on one GPU: "
          "use tensor (or auto)")
    if r.colocate and r.engine == "sglang" and r.sglang.placement == "ray":
        validate_colocated_ray_servers(cfg)


def validate_colocated_ray_servers(cfg: ExperimentConfig) -> None:
    """Colocated servers placed by Ray run on the nodes of each agent's Ray ranks, ``rollout.sglang.tp`` of
    that node's trainer GPUs per server (rollout/engine_actor.py): the agents must train on Ray workers,
    their GPUs are the ranks' own (none listed), every node's share of ranks holds whole servers, and the
    weights come through a folder every node reads (CUDA IPC reaches the controller's node only)."""
    r, tp = cfg.rollout, cfg.rollout.sglang.tp
    mode = r.weight_sync if r.weight_sync != "auto" else r.sglang.auto_weight_sync(True)
    _rule(mode == "disk", "rollout.weight_sync", r.weight_sync,
          "colocated servers with rollout.sglang.placement=ray run on the trainer ranks' nodes, which CUDA IPC "
          "(tensor) from the controller's node does not reach: use disk (or auto), a folder on the filesystem "
          "every node shares")
    for i, agent in enumerate(cfg.agents):
        _rule(agent.uses_ray_workers, f"agents.{i}.workers", agent.workers,
              "colocated servers with rollout.sglang.placement=ray follow the agent's Ray ranks onto their nodes; "
              "an agent trained in the controller process shares its GPUs with rollout.sglang.placement=local")
        _rule(not agent.rollout_gpu_ids, f"agents.{i}.rollout_gpu_ids", agent.rollout_gpu_ids,
              "colocated servers with rollout.sglang.placement=ray take the GPUs of the agent's trainer ranks on "
              "each node: leave it empty")
        world = agent.parallel.world_size
        _rule(world % tp == 0, "rollout.sglang.tp", tp,
              f"agent {agent.name!r} trains on {world} GPUs: colocated servers of tp={tp} GPUs each must tile the "
              "trainer ranks' GPUs of every node (a divisor of each node's share)")
