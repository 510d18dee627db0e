"""sync stage: trainer → rollout-engine weight transfer (HF-named full tensors) and its check.

One module per transport: ``inprocess`` (the HF engine copies tensors in place; also the loop's
entry points), ``disk`` (safetensors folder), ``tensor`` (CUDA IPC for colocated SGLang servers,
GPUs named by UUID in ``cuda_ipc``), ``distributed`` (bucketed broadcast from trainer rank 0 to every
engine rank). ``base`` holds the protocol they share, ``engines`` builds an agent's servers and
transport from the configuration.
"""

from hacrl_megatron.sync.inprocess import SYNC_TOLERANCE_PER_TOKEN, WeightSyncError, check_sync, sync_weights

__all__ = ["SYNC_TOLERANCE_PER_TOKEN", "WeightSyncError", "check_sync", "sync_weights"]
