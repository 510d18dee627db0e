"""What `hacrl train --agent NAME` and `hacrl launch --agent/--per-agent-jobs` need of a config beyond its own
rules (docs/exchange.md): the agent exists among several, and the exchange lets separate jobs meet."""

from __future__ import annotations

from hacrl_megatron.config.schema import ExperimentConfig
from hacrl_megatron.errors import InputError


def agent_index(exp: ExperimentConfig, name: str) -> int:
    """The config index of agent ``name``; one line naming the agents otherwise."""
    names = [a.name for a in exp.agents]
    if name not in names:
        raise InputError(f"--agent {name!r}: no such agent in this config; its agents are {names}")
    if len(names) < 2:
        raise InputError(f"--agent {name!r}: this config has one agent; run it without --agent")
    return names.index(name)


def check_exchange_config(exp: ExperimentConfig) -> None:
    """What ``--agent`` needs beyond the config's own rules: a store other jobs reach, and an eos rule that
    needs no peer tokenizer."""
    x = exp.exchange
    if x.backend == "local":
        raise InputError("--agent runs one agent of the run in this process; its peers run as other jobs, which "
                         "the local exchange cannot reach: set exchange.backend=shared_dir (with exchange.dir) or "
                         "exchange.backend=redis (with exchange.redis_url)")
    if exp.rollout.eos_mode == "source_eos_text":
        raise InputError("--agent with rollout.eos_mode=source_eos_text: that rule encodes each peer's eos string "
                         "with the peer's tokenizer, which a separate job does not hold; use learner_eos, no_eos or "
                         "strip_all")
