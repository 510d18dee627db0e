"""One agent of a multi-agent run trained as its own job (``hacrl train --agent NAME``, docs/exchange.md).

The job builds its own agent only. Each step it samples, scores and computes π_old of its own
responses exactly as a one-process run does, then publishes them as one
:class:`~hacrl_megatron.exchange.remote.PeerRecord` and waits for its peers' records of the same
step; the peers' responses join the step's data as text-only trajectories
(:attr:`~hacrl_megatron.exchange.records.Trajectory.is_remote`), and from there the step is the
one-process step seen from this learner: the same advantages (eq. 6-7, over every agent's rewards),
the same capability tracker (eq. 8-9, every agent's positive rate), the same cross ratios (eq. 11,
with the author's Σ log π_old and L_j from the record).

A peer whose record does not come within ``exchange.wait_s`` is waited for (``on_missing: wait``, a
log line per minute naming it) or left out of the step (``on_missing: alone``): the step then trains
on this agent's own responses with GSPO's objective, does not update the tracker (it needs every
agent's rate), and logs ``<agent>/exchange/peers_missing``. A peer that comes back is used again from
the step it publishes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any

import torch

from hacrl_megatron.algo import Algorithm, build_algorithm, positive_rate
from hacrl_megatron.config import ExperimentConfig
from hacrl_megatron.errors import InputError
from hacrl_megatron.exchange.records import Trajectory
from hacrl_megatron.exchange.remote import ExchangeStore, PeerRecord, open_store
from hacrl_megatron.exchange.remote.record import refusal
from hacrl_megatron.exchange.retokenize import batch_decode
from hacrl_megatron.trainer.run_identity import digest_of, mismatch, shared_config_fields
from hacrl_megatron.trainer.stages import StepData

logger = logging.getLogger(__name__)

WAIT_LOG_EVERY_S = 60.0  # on_missing=wait: one line per this many seconds naming the peers still missing


@dataclass(frozen=True)
class PeerAgent:
    """An agent of the run that another job trains: its config index and name, nothing to run."""

    index: int
    name: str


class AgentTakenOver(InputError):
    """Another job claimed this job's agent in the exchange (a second job of the same agent, or a restart of
    this one elsewhere): this job stops so that one job only publishes the agent's records."""


class ExchangeMismatch(InputError):
    """A peer's valid record that cannot belong to this run's step (other prompts, another group size or
    configuration): the jobs were started differently. Stops the run, naming the peer and the field."""


def exchange_run_id(exp: ExperimentConfig) -> str:
    """What every job of the run shares in the exchange: ``exchange.run_id``, else the config's name."""
    return exp.exchange.run_id or exp.name


def version_lag(exp: ExperimentConfig) -> int:
    """How many weight versions a step's rollouts may lag behind the step (docs/algorithm.md §7b)."""
    return {"sync": 0, "one_step_off": 1}.get(exp.train.rollout_mode, exp.train.max_staleness)


def open_exchange_store(exp: ExperimentConfig) -> ExchangeStore:
    """The store ``exchange.*`` names, connected (a Redis server answered PING, the folder exists) and with its
    key loaded; raises one line naming the option, file, folder or server that is not usable."""
    x = exp.exchange
    return open_store(x.backend, exchange_run_id(exp), dir=x.dir, redis_url=x.redis_url,
                      redis_password_file=x.redis_password_file, redis_ca_file=x.redis_ca_file, key_file=x.key_file)


class PeerExchange:
    """This job's side of the exchange: publish the own record of a step, gather and check the peers'.

    ``agents``: every agent of the run in config order (this job's own runtime at ``own``'s index,
    :class:`PeerAgent` for the others).
    """

    def __init__(self, exp: ExperimentConfig, agents: list[Any], own: Any, store: ExchangeStore) -> None:
        self.exp, self.agents, self.own, self.store = exp, agents, own, store
        self.peers = [a for a in agents if a.index != own.index]
        self.config_fields = shared_config_fields(exp)
        self.digest = digest_of(self.config_fields)
        self.lag = version_lag(exp)
        self._last_version: dict[str, int] = {}  # per peer: the newest weights version of a record used
        self._alone: dict[str, Algorithm] = {}  # the fallback algorithm of a step with a peer left out, built once
        # this job's id in the agent's claim: another job that claims the agent later takes it over
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(6)}"

    @classmethod
    def open(cls, exp: ExperimentConfig, agents: list[Any], own: Any) -> PeerExchange:
        return cls(exp, agents, own, open_exchange_store(exp))

    def check_fresh(self) -> None:
        """A fresh run (not a resume) refuses a store that already holds this agent's records of its run id:
        they belong to an earlier run, and its peers could read them as this run's."""
        found = self.store.steps(self.own.name)
        if found:
            raise InputError(f"exchange run {self.store.run_id!r} ({self._where()}) already holds agent "
                             f"{self.own.name!r}'s records of steps {found[0]}..{found[-1]} from an earlier run: set "
                             "another exchange.run_id, delete those records, or continue that run with "
                             "checkpoint.resume=true")

    def join_run(self) -> None:
        """Join the exchange's current run (a fresh job starts a new one where its agent took part in the
        newest): every record published carries the run's nonce and records of another are refused."""
        nonce = self.store.join_run(self.own.name, fresh=not self.exp.checkpoint.resume)
        logger.info("exchange run %r (%s): run nonce %s", self.store.run_id, self._where(), nonce)

    def take_agent(self) -> None:
        """Claim this job's agent in the exchange (a job of the same agent running elsewhere stops at its next
        publish, :class:`AgentTakenOver`)."""
        self.store.claim(self.own.name, self.holder)

    def _where(self) -> str:
        x = self.exp.exchange
        return {"shared_dir": f"exchange.dir {x.dir}", "redis": f"exchange.redis_url {x.redis_url}"}.get(
            x.backend, x.backend)

    def publish(self, step: int, data: StepData, behaviour: dict[str, torch.Tensor], weights_version: int) -> None:
        """Publish this agent's responses of ``step``: the text as a learner decodes the ids, the rewards,
        and Σ log π_old — Σ log π_behav instead where the batch lags behind the weights (a peer's learner
        treats that as the proximal policy of a cross row, docs/algorithm.md §7b)."""
        own = self.own
        holder = self.store.holder_of(own.name)
        if holder != self.holder:
            raise AgentTakenOver(f"exchange run {self.store.run_id!r} ({self._where()}): agent {own.name!r} was "
                                 f"claimed by another job ({holder}) after this one ({self.holder}); this job stops "
                                 "so that one job only trains and publishes the agent")
        trajs = data.trajectories[own.name]
        stale = behaviour.get(own.name)
        record = PeerRecord.from_trajectories(
            run_id=self.store.run_id, step=step, agent=own.name, weights_version=weights_version,
            prompt_ids=[p.id for p in data.prompts], trajectories=trajs,
            positive_rate=positive_rate(data.rewards[:, 0]),
            texts=batch_decode(own.tokenizer, [list(t.token_ids) for t in trajs]),
            logp_sums=None if stale is None else [float(v) for v in stale.tolist()], config_digest=self.digest,
            config_fields=self.config_fields, run_nonce=self.store.run_nonce)
        self.store.publish(record)

    def gather(self, step: int) -> tuple[dict[str, PeerRecord], list[str]]:
        """The peers' valid records of ``step`` and the peers left out (``on_missing``)."""
        x = self.exp.exchange
        names = [p.name for p in self.peers]
        found = self.store.wait_for(step, names, x.wait_s)
        records, missing = dict(found.records), list(found.missing)
        waited = found.waited_s
        while missing and x.on_missing == "wait":
            logger.warning("step %d: waiting for the exchange record of %s (%.0f s so far, exchange.on_missing=wait)%s",
                           step, ", ".join(repr(m) for m in missing), waited,
                           "".join(f"; {r}" for r in found.refused.values()))
            found = self.store.wait_for(step, missing, WAIT_LOG_EVERY_S)
            records.update(found.records)
            missing, waited = list(found.missing), waited + found.waited_s
        if missing:
            logger.warning("step %d: no exchange record of %s within exchange.wait_s=%g s: this step trains %r on its "
                           "own responses (exchange.on_missing=alone)", step, ", ".join(map(repr, missing)), x.wait_s,
                           self.own.name)
        return records, missing

    def merge(self, step: int, data: StepData, records: dict[str, PeerRecord],
              behaviour: dict[str, torch.Tensor]) -> StepData:
        """``data`` (this agent's responses only) with the peers' responses from ``records`` added, all agents'
        rewards as [P, n, G] in config order (zeros for a peer left out); a lagging peer's Σ log π_behav
        joins ``behaviour`` (as the one-process run has it)."""
        own, g = self.own, data.rewards.shape[2]
        rewards = torch.zeros(len(data.prompts), len(self.agents), g, dtype=data.rewards.dtype)
        rewards[:, own.index] = data.rewards[:, 0]
        trajectories: dict[str, list[Trajectory]] = {}
        for agent in self.agents:
            if agent.index == own.index:
                trajectories[own.name] = data.trajectories[own.name]
                continue
            record = records.get(agent.name)
            if record is None:
                continue
            self._check(step, record, data, g)
            trajectories[agent.name] = _trajectories(record, data)
            rewards[:, agent.index] = torch.tensor(record.rewards, dtype=data.rewards.dtype)
            if record.weights_version < step:
                behaviour[agent.name] = torch.tensor([v for row in record.logp_sums for v in row], dtype=torch.float64)
        return dataclasses.replace(data, trajectories=trajectories, rewards=rewards)

    def _check(self, step: int, record: PeerRecord, data: StepData, g: int) -> None:
        """A record that passed the store's checks but cannot be this step's: refuse, naming the field."""
        origin = f"step {step}"
        if record.config_digest != self.digest:
            differs = mismatch(self.config_fields, record.config_fields)
            named = (f"they differ on {differs} (its setting's digest {record.config_fields.get(differs)!r}, this "
                     f"job's {self.config_fields.get(differs)!r})" if differs and record.config_fields else
                     "the record names no settings")
            raise ExchangeMismatch(str(refusal(
                record.agent, origin, "config_digest",
                f"{record.config_digest!r}, this job's is {self.digest!r}: the jobs run different configurations; "
                f"{named}")))
        low, last = max(0, step - self.lag), self._last_version.get(record.agent, 0)
        if not low <= record.weights_version <= step or record.weights_version < last:
            raise ExchangeMismatch(str(refusal(
                record.agent, origin, "weights_version",
                f"{record.weights_version}; a record of step {step} must come from weights {low}..{step} "
                f"(train.rollout_mode={self.exp.train.rollout_mode}) and no older than the {last} of its last record")))
        self._last_version[record.agent] = record.weights_version
        ids = [p.id for p in data.prompts]
        if list(record.prompt_ids) != ids:
            raise ExchangeMismatch(str(refusal(record.agent, origin, "prompt_ids",
                                               f"{list(record.prompt_ids)[:3]}..., this job sampled {ids[:3]}...: the "
                                               "jobs read different data")))
        sizes = {len(row) for row in record.responses}
        if sizes != {g}:
            raise ExchangeMismatch(str(refusal(record.agent, origin, "responses",
                                               f"groups of {sorted(sizes)} responses, this job samples {g}")))

    def step_algorithm(self, algorithm: Algorithm, missing: list[str]) -> Algorithm:
        """The step's algorithm: the run's, or its ``alone_method`` (GSPO; GRPO for the token-level methods of
        docs/algorithm.md §8a) when a peer is left out of a step of a method that needs every agent's responses
        or rewards."""
        if not (missing and algorithm.needs_peers):
            return algorithm
        name = algorithm.alone_method
        if name not in self._alone:
            self._alone[name] = build_algorithm(dataclasses.replace(self.exp.hacpo, algorithm=name), len(self.agents))
        return self._alone[name]

    def prune(self, step: int) -> None:
        self.store.prune(self.own.name, step, self.exp.exchange.keep_steps)

    def close(self) -> None:
        self.store.close()


def _trajectories(record: PeerRecord, data: StepData) -> list[Trajectory]:
    """A peer's record as text-only trajectories, prompt-major [P·G] like the step's own."""
    questions = {p.id: p.question for p in data.prompts}
    out = []
    for pid, texts, finishes, rewards, sums, lens, counts in zip(
            record.prompt_ids, record.responses, record.finish_reasons, record.rewards, record.logp_sums,
            record.lengths, record.response_tokens):
        for text, finish, reward, logp, length, count in zip(texts, finishes, rewards, sums, lens, counts):
            # L_j <= the response's tokens (+ eos) was checked with the record (record._check_consistency)
            out.append(Trajectory(prompt_id=pid, source=record.agent, prompt_text=questions[pid], response_text=text,
                                  token_ids=(), finish_reason=finish, reward=reward, source_len=length,
                                  policy_version=record.weights_version, source_logp_sum=logp, remote_tokens=count))
    return out
