"""sync stage: trainer → rollout-engine weight transfer (HF-named full tensors) and its check."""

from hacrl_megatron.sync.inprocess import SYNC_TOLERANCE_PER_TOKEN, WeightSyncError, check_sync, sync_weights

__all__ = ["SYNC_TOLERANCE_PER_TOKEN", "WeightSyncError", "check_sync", "sync_weights"]
