"""The rules of the supervised warm-up (``hacrl pretrain``, trainer/pretrain.py): snapshots of one run
(``agents.*.warmup_sft_from``) and warm-ups on a mixture of the task's problem families
(``agents.*.warmup_sft_families``). Each failure names field, value and rule, as every rule of
config/validation.py does."""

from __future__ import annotations

import math
from typing import Any

from hacrl_megatron.config.bounded_yaml import short_repr
from hacrl_megatron.config.schema import AgentConfig, ConfigError, ExperimentConfig


def _rule(ok: bool, path: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{path}={short_repr(value)}: {rule}")


SHARED_WARMUP_FIELDS = ("model", "tokenizer", "prompt_template", "backend", "warmup_sft_lr", "warmup_sft_batch",
                        "warmup_sft_eval_every", "warmup_sft_families")


def validate_shared_warmups(agents: list[AgentConfig]) -> None:
    """``warmup_sft_from``: a later snapshot of an earlier agent's warm-up run needs the same run (every
    field of ``SHARED_WARMUP_FIELDS`` equal) and a higher accuracy target than the snapshot it follows."""
    earlier: dict[str, AgentConfig] = {}
    for i, agent_cfg in enumerate(agents):
        lead_name, path = agent_cfg.warmup_sft_from, f"agents.{i}.warmup_sft_from"
        if lead_name is not None:
            lead = earlier.get(lead_name)
            _rule(lead is not None, path, lead_name, f"must name an earlier agent, one of {sorted(earlier)}")
            _rule(lead.warmup_sft_from is None, path, lead_name,
                  f"agent {lead_name!r} itself follows {lead.warmup_sft_from!r}: name the first agent of the run")
            for name in SHARED_WARMUP_FIELDS:
                _rule(getattr(agent_cfg, name) == getattr(lead, name), f"agents.{i}.{name}", getattr(agent_cfg, name),
                      f"must equal {lead_name}'s: one warm-up run makes both snapshots")
            _rule(agent_cfg.warmup_sft_target > lead.warmup_sft_target, f"agents.{i}.warmup_sft_target",
                  agent_cfg.warmup_sft_target, f"must exceed {lead_name}'s {lead.warmup_sft_target}: "
                  "the later snapshot of one run")
        earlier[agent_cfg.name] = agent_cfg


def validate_warmup_families(cfg: ExperimentConfig) -> None:
    """``agents.*.warmup_sft_families`` (family → sampling weight of the warm-up's problems): only for a task
    with families (``data.task``), each name one of its families, each weight finite and >= 0, some > 0."""
    from hacrl_megatron.data.procedural import TASKS

    task = TASKS.get(cfg.data.task)
    families = task.families if task is not None else ()
    for i, agent_cfg in enumerate(cfg.agents):
        weights, path = agent_cfg.warmup_sft_families, f"agents.{i}.warmup_sft_families"
        if not weights:
            continue
        _rule(bool(families), path, weights,
              f"data.task={cfg.data.task!r} has no problem families; tasks with families: "
              f"{sorted(name for name, t in TASKS.items() if t.families)}")
        for family, weight in weights.items():
            _rule(family in families, f"{path}.{family}", weight,
                  f"{family!r} is not a family of data.task={cfg.data.task!r}: one of {list(families)}")
            _rule(math.isfinite(weight) and weight >= 0, f"{path}.{family}", weight,
                  "must be a finite sampling weight >= 0")
        _rule(any(w > 0 for w in weights.values()), path, weights, "needs one family of positive weight")
