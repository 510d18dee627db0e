"""An agent's SGLang servers, their clients and the weight transport, from the configuration.

``agents.N.rollout_gpu_ids`` lists k · ``rollout.sglang_tp`` GPUs: k servers, one per consecutive
group (empty: one server that inherits this process's GPUs). ``rollout.weight_sync`` picks the
transport (auto: tensor when ``rollout.colocate``, else distributed); colocated servers start with
``--enable-memory-saver`` so that they can release their memory while the trainer trains.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hacrl_megatron.config import (
    AgentConfig,
    ExperimentConfig,
    RolloutConfig,
    resolve_weight_sync,
    sglang_python,
)
from hacrl_megatron.rollout.engine_pool import EnginePool
from hacrl_megatron.rollout.sglang_engine import SGLangEngine
from hacrl_megatron.rollout.sglang_server import SGLangServer
from hacrl_megatron.sync.base import WeightTransport

MEMORY_SAVER_FLAG = "--enable-memory-saver"


def gpu_groups(gpu_ids: list[int], tp: int) -> list[list[int] | None]:
    """One GPU list per engine: consecutive groups of ``tp`` ids; ``[None]`` (inherit) when empty."""
    if not gpu_ids:
        return [None]
    if len(gpu_ids) % tp:
        raise ValueError(f"gpu_groups: {len(gpu_ids)} GPU ids are not a multiple of sglang_tp={tp}")
    return [list(gpu_ids[k: k + tp]) for k in range(0, len(gpu_ids), tp)]


def make_transport(r: RolloutConfig, agent_name: str, sync_dir: Path, base_model_dir: Path) -> WeightTransport:
    """The transport ``rollout.weight_sync`` names (auto resolved)."""
    from hacrl_megatron.sync.disk import DiskTransport
    from hacrl_megatron.sync.distributed import DistributedTransport
    from hacrl_megatron.sync.tensor import TensorTransport

    mode, bucket = resolve_weight_sync(r), r.weight_sync_bucket_mb << 20
    if mode == "disk":
        return DiskTransport(sync_dir, base_model_dir)
    if mode == "tensor":
        return TensorTransport(bucket)
    return DistributedTransport(bucket, group_name=f"hacrl_{agent_name}")


def _start_all(servers: list[SGLangServer]) -> None:
    """Start every server concurrently; if one fails, stop the others and re-raise."""
    with ThreadPoolExecutor(max_workers=len(servers), thread_name_prefix="sglang-start") as pool:
        futures = [pool.submit(s.start) for s in servers]
        errors = [f.exception() for f in futures]
    if any(errors):
        for s in servers:
            s.stop()
        raise next(e for e in errors if e is not None)


def start_sglang_pool(exp: ExperimentConfig, cfg: AgentConfig, model: Any, tokenizer: Any) -> EnginePool:
    """Start the agent's servers on its initial weights and return the pool that drives them."""
    r = exp.rollout
    root = Path(exp.output_dir) / "engines" / cfg.name
    init_dir = root / "init"
    model.save_pretrained(init_dir)  # the servers load it; also the config source of disk sync folders
    tokenizer.save_pretrained(init_dir)
    command = [a.replace("{model_path}", str(init_dir)) for a in r.sglang_command] or None
    extra = list(r.sglang_args)
    if r.colocate and MEMORY_SAVER_FLAG not in extra:
        extra.append(MEMORY_SAVER_FLAG)
    servers = [SGLangServer(init_dir, tp_size=r.sglang_tp, gpu_ids=gpus, mem_fraction_static=r.sglang_mem_fraction,
                            extra_args=extra, log_path=root / f"server{k}.log", command=command,
                            python=None if command else sglang_python(r))
               for k, gpus in enumerate(gpu_groups(cfg.rollout_gpu_ids, r.sglang_tp))]
    _start_all(servers)
    engines = [SGLangEngine(s.base_url, eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer, tp_size=r.sglang_tp,
                            server=s, name=f"engine{k}") for k, s in enumerate(servers)]
    return EnginePool(engines, make_transport(r, cfg.name, root / "synced", init_dir), colocate=r.colocate,
                      name=cfg.name)
