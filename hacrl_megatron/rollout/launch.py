"""Starting an agent's engine clients from the configuration, whichever engine ``rollout.engine`` names.

Each engine has one module in ``rollout/`` that defines its client and
``start_engines(exp, agent_cfg, model, tokenizer, root, hf_config=None) -> StartedEngines``: start the
agent's engines on ``model``'s weights (an HF model, or an HF folder for engines that run as servers)
(files under ``root``, the agent's engine folder) and return their clients
(:class:`~hacrl_megatron.rollout.protocol.StartedEngines`). A run hands them its resolved agent
(``models/resolved.py``): ``agent_cfg`` with ``model.dtype`` resolved and the agent's ``hf_config``,
so no engine reads the model's config again (``hf_config=None``: read from ``model`` when needed). :data:`ENGINE_MODULES` maps the
engine's name to that module, imported only when the engine is chosen (so SGLang's module never
loads on a CPU run). The weight transport that reaches the clients is built by ``sync/``; the trainer
puts both in an :class:`~hacrl_megatron.rollout.engine_pool.EnginePool` (``trainer/runtime.py``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hacrl_megatron.rollout.protocol import StartedEngines

if TYPE_CHECKING:
    from hacrl_megatron.config import ExperimentConfig
    from hacrl_megatron.models.resolved import ResolvedAgent

# rollout.engine -> the module whose start_engines starts that engine (config/schema.py: ENGINES)
ENGINE_MODULES = {
    "hf": "hacrl_megatron.rollout.hf_engine",
    "sglang": "hacrl_megatron.rollout.sglang_server",
    "vllm": "hacrl_megatron.rollout.vllm_server",
}


def engine_root(exp: ExperimentConfig, agent_name: str) -> Path:
    """The agent's engine folder: initial weights, server logs, weight-sync folders."""
    return Path(exp.output_dir) / "engines" / agent_name


def start_engines(exp: ExperimentConfig, agent: ResolvedAgent, model: Any, tokenizer: Any,
                  trainer_placement: list[dict[str, Any]] | None = None) -> StartedEngines:
    """Start ``agent``'s engines on ``model``'s weights: an HF model in this process, or (server
    engines only: the in-process HF engine needs the model itself) the path of an HF folder.
    ``trainer_placement``: where the agent's Ray ranks run, for colocated servers placed by Ray (SGLang's
    starter alone takes it: config validation allows such servers for SGLang only)."""
    name = exp.rollout.engine
    if name not in ENGINE_MODULES:
        raise ValueError(f"rollout.engine={name!r}: no engine module; known: {sorted(ENGINE_MODULES)}")
    module = importlib.import_module(ENGINE_MODULES[name])
    where = {} if trainer_placement is None else {"trainer_placement": trainer_placement}
    started = module.start_engines(exp, agent.cfg, model, tokenizer, engine_root(exp, agent.name),
                                   hf_config=agent.hf_config, **where)
    if not started.clients:
        raise ValueError(f"rollout.engine={name!r}: agent {agent.name!r} got no engine")
    return started
