"""The training side of an agent: its trainer (docs/architecture.md, "One agent = one Megatron world").

An ``AgentHandle`` (handle.py) is what the loop asks of an agent's trainer: log-probs, M optimizer
updates, weight export, checkpoints, weight snapshots. Implementations: ``LocalAgent`` (megatron-core
in this process), ``RayAgent`` (the agent's TP×PP×DP ranks as Ray actors) and ``HFAgent`` (plain
transformers, the reference). The agent as a whole, trainer beside its rollout engine, is
``trainer.runtime.AgentRuntime`` (``rt.trainer``, ``rt.engine``).
"""
