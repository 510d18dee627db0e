"""hacrl_megatron: Heterogeneous Agent Collaborative RL (HACPO) with Megatron-core agents.

Stages follow the data flow of one step (see README): rollout → reward → exchange → algo →
agents → sync → trainer. Heavy backends (megatron-core, transformers, triton, sglang, nemo-run)
are imported lazily inside the modules that need them.
"""

__version__ = "0.1.0"
