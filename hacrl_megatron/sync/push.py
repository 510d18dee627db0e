"""How the trainer's weights reach an agent's engine: the loop's entry point and the transport the
configuration names.

:func:`sync_weights` hands the agent's HF-named export (gathered across TP/PP for Megatron agents)
to the engine's ``sync_from``: the in-process HF engine copies the tensors into its model
(``rollout.weight_sync: inprocess``); an :class:`~hacrl_megatron.rollout.engine_pool.EnginePool`
sends them through its transport, which :func:`make_transport` builds from ``rollout.weight_sync``
(``auto`` resolved by the engine's section, :func:`resolve_weight_sync`). A vLLM server takes
``tensor`` and ``distributed`` through vLLM's own weight-transfer engine (``vllm_ipc``, ``vllm_nccl``).
A Ray agent's ``distributed`` push runs on its own ranks: from rank 0 (``distributed``, ``vllm_nccl``),
or with PP > 1 from every pipeline stage's first rank, each sending its own stage's share
(``stages``, ``vllm_stages``; docs/weight_sync.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hacrl_megatron.agents.handle import AgentHandle
from hacrl_megatron.config import RolloutConfig
from hacrl_megatron.rollout.types import TrainingEngine

if TYPE_CHECKING:
    from hacrl_megatron.rollout.protocol import WeightTransport
    from hacrl_megatron.sync.distributed import RankSource


def sync_weights(agent: AgentHandle, engine: TrainingEngine) -> int:
    """Push ``agent``'s HF-named weights into ``engine``; returns the number of tensors sent."""
    return engine.sync_from(agent.export_hf_weights)


def resolve_weight_sync(r: RolloutConfig, ray_agent: bool = False) -> str:
    """``rollout.weight_sync`` with auto resolved by the engine's section for an agent (``ray_agent``:
    its ranks are Ray actors): ``rollout.hf``: inprocess; ``rollout.sglang``: tensor when colocated,
    else distributed; ``rollout.vllm``: distributed for a Ray agent's separate servers on CUDA, else disk."""
    if r.weight_sync != "auto":
        return r.weight_sync
    import torch

    return r.engine_settings.auto_weight_sync(r.colocate, ray_agent=ray_agent, cuda=torch.cuda.is_available())


def make_transport(r: RolloutConfig, agent_name: str, sync_dir: Path | None, base_model_dir: Path | None,
                   ranks: RankSource | None = None) -> WeightTransport:
    """The transport ``rollout.weight_sync`` names (auto resolved) for agent ``agent_name``.

    ``sync_dir``: the disk transport's version folders; ``base_model_dir``: a folder whose config
    files complete each version folder (None: safetensors only); ``ranks``: an agent whose own ranks
    broadcast (a Ray agent; distributed transport only; with more than one pipeline stage, each
    stage's first rank sends its own stage's share, ``sync/stages.py``).
    """
    from hacrl_megatron.sync.disk import DiskTransport
    from hacrl_megatron.sync.distributed import DistributedTransport
    from hacrl_megatron.sync.tensor import TensorTransport

    mode, bucket = resolve_weight_sync(r, ray_agent=ranks is not None), r.weight_sync_bucket_mb << 20
    stages = ranks is not None and getattr(ranks, "pipeline_stages", 1) > 1
    if mode == "disk":
        if sync_dir is None:
            raise ValueError(f"make_transport: rollout.weight_sync=disk for agent {agent_name!r} needs a sync_dir")
        return DiskTransport(sync_dir, base_model_dir)
    if r.engine == "vllm" and mode in ("tensor", "distributed"):  # vLLM's own receivers, not SGLang's routes
        from hacrl_megatron.sync.vllm_ipc import VLLMIPCTransport
        from hacrl_megatron.sync.vllm_nccl import VLLMNCCLTransport
        from hacrl_megatron.sync.vllm_stages import VLLMStageTransport

        if mode == "tensor":
            return VLLMIPCTransport(bucket)
        return VLLMStageTransport(bucket, ranks=ranks) if stages else VLLMNCCLTransport(bucket, ranks=ranks)
    if mode == "tensor":
        return TensorTransport(bucket)
    if mode == "distributed":
        if stages:
            from hacrl_megatron.sync.stages import StageTransport

            return StageTransport(bucket, group_name=f"hacrl_{agent_name}", ranks=ranks)
        return DistributedTransport(bucket, group_name=f"hacrl_{agent_name}", ranks=ranks)
    raise ValueError(f"make_transport: rollout.weight_sync={mode!r} needs no transport (the engine copies the "
                     "trainer's tensors itself)")
