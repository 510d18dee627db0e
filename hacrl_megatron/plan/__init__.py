"""Placement and memory planner for HACRL experiments (``hacrl plan``; docs/planner.md).

Pure arithmetic on HF configs: exact per-rank parameter counts (:mod:`.params`, checked against
meta-device builds of the provider), per-GPU memory (:mod:`.memory`), step-time estimates
(:mod:`.timing`), a layout search over a whole cluster (:mod:`.search`) and its report
(:mod:`.report`). Nothing here imports megatron-core except :mod:`.params` through the provider's
:class:`~hacrl_megatron.models.provider.ArchSpec`.
"""
