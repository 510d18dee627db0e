"""launch stage of hacrl_megatron: NeMo-Run recipes (local, Slurm with a Ray cluster, Docker).

Names are resolved lazily (PEP 562): importing this package imports neither ``nemo_run`` nor the
submodules, so ``python -m hacrl_megatron.launch.slurm_ray`` runs on nodes without NeMo-Run.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "local_executor": "executors", "slurm_executor": "executors", "docker_executor": "executors",
    "require_nemo_run": "executors", "SlurmJob": "executors",
    "LaunchError": "recipes", "LaunchResult": "recipes", "build_task": "recipes", "hacrl_command": "recipes",
    "launch_train": "recipes",
    "ray_cluster_script": "slurm_ray",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hacrl_megatron.launch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hacrl_megatron.launch.{_EXPORTS[name]}"), name)
