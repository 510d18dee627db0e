"""sync stage: trainer → rollout-engine weight transfer (HF-named full tensors) and its check.

One module per transport: ``disk`` (safetensors folder), ``tensor`` (CUDA IPC for colocated
servers, GPUs named by UUID in ``cuda_ipc``), ``distributed`` (bucketed broadcast from trainer rank
0 to every engine rank), ``stages`` (the same from every pipeline stage of a Ray agent at once,
each stage its own share; ``vllm_stages`` for vLLM). Each calls the weight-update operations of
``rollout/protocol.py`` on the engine clients, never an engine's own API. ``base`` holds what they share, ``push`` the loop's entry
point and the transport the configuration names, ``check`` the post-sync check every transport is
held to. The in-process HF engine copies the tensors itself (``rollout.weight_sync: inprocess``).
"""

from hacrl_megatron.sync.check import SYNC_TOLERANCE_PER_TOKEN, WeightSyncError, check_sync
from hacrl_megatron.sync.push import make_transport, resolve_weight_sync, sync_weights

__all__ = ["SYNC_TOLERANCE_PER_TOKEN", "WeightSyncError", "check_sync", "make_transport", "resolve_weight_sync",
           "sync_weights"]
