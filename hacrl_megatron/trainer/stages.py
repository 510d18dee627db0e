"""The stages of one HACRL step, one function each (docs/architecture.md, data flow).

rollout → verify → old log-probs → learner views + advantages → loss function. The loop in
``loop.py`` calls them in order; each is testable alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hacrl_megatron.agents.batch import LogProbOutput, SequenceBatch
from hacrl_megatron.algo import Algorithm, LossInputs
from hacrl_megatron.config import ExperimentConfig
from hacrl_megatron.data.records import PromptRecord
from hacrl_megatron.exchange.records import LearnerView, Trajectory
from hacrl_megatron.exchange.retokenize import Exchange
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.reward.verify import RewardRequest
from hacrl_megatron.rollout.types import Completion, SamplingParams
from hacrl_megatron.trainer.concurrency import for_each, runs_in_process
from hacrl_megatron.trainer.runtime import AgentRuntime


def step_seed(exp: ExperimentConfig, step: int, salt: int) -> int:
    """A seed that depends only on (run seed, step, salt): resumed runs sample identically."""
    return (exp.train.seed * 1_000_003 + step * 7919 + salt * 104_729) % (2**31 - 1)


@dataclass
class PassOutputs:
    """The extra forward passes a step's algorithm asked for (:class:`~hacrl_megatron.algo.StepPasses`),
    filled by :func:`old_logprobs`; empty where a pass was not asked for.

    source_token_logps: agent → one [L_j] float tensor per trajectory, its per-token log π^(j)_old.
    learner_old_on_others: learner → source → [P·G] float64 Σ log π^(learner)_old over the source's
        responses re-tokenized into the learner's tokens (docs/algorithm.md §5d, §8).
    reference_on_self: agent → one [L_j] float tensor per trajectory, the frozen starting policy's
        per-token log-probs of the agent's own responses (the KL penalty, §7).
    behaviour_on_self: agent → [P·G] float64 Σ log π_behav of its own responses under the weights that
        sampled them, for agents whose batch lags behind their current weights (§7b); absent: fresh.
    """

    source_token_logps: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    learner_old_on_others: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    reference_on_self: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    behaviour_on_self: dict[str, torch.Tensor] = field(default_factory=dict)  # agent → [P·G] Σ log π_behav (§7b)


def _per_sequence(out: LogProbOutput) -> list[torch.Tensor]:
    """A packed LogProbOutput's per-token log-probs split into one [L_s] tensor per sequence."""
    return [out.token_logps[out.cu_seqlens[i]:out.cu_seqlens[i + 1]] for i in range(len(out.seq_len))]


@dataclass
class StepData:
    """Everything sampled and scored in one step. ``trajectories[a]`` is agent a's, prompt-major [P·G]."""

    prompts: list[PromptRecord]
    trajectories: dict[str, list[Trajectory]]
    rewards: torch.Tensor  # [P, n, G] float32, agents in config order
    passes: PassOutputs = field(default_factory=PassOutputs)


def rollout(runtimes: list[AgentRuntime], prompts: list[PromptRecord], exp: ExperimentConfig, algorithm: Algorithm,
            step: int) -> dict[str, list[list[Completion]]]:
    """Every agent samples G responses per prompt with its pre-step weights: name → [P][G] Completion.
    Agents whose engines run elsewhere generate at the same time (trainer/concurrency.py)."""
    r = exp.rollout

    def sample(rt: AgentRuntime) -> list[list[Completion]]:
        params = SamplingParams(n=algorithm.samples_per_prompt(r.samples_per_prompt), temperature=r.temperature,
                                top_p=r.top_p, max_new_tokens=r.max_response_len,
                                seed=step_seed(exp, step, rt.index))
        return rt.engine.generate([rt.prompt_ids(p.question) for p in prompts], params)

    done = for_each(runtimes, sample, lambda rt: runs_in_process(rt.engine))
    return {rt.name: completions for rt, completions in zip(runtimes, done)}


def verify(verifier: VerifierPool, prompts: list[PromptRecord], completions: dict[str, list[list[Completion]]],
           step: int, max_response_len: int) -> StepData:
    """Score every response once with the shared verifier; the reward is shared by all learners."""
    names = list(completions)
    requests = [RewardRequest(p.kind, c.text, p.answer, p.source, p.extra)
                for name in names for p, group in zip(prompts, completions[name]) for c in group]
    scores = verifier.score(requests)
    g = len(completions[names[0]][0]) if prompts else 0
    rewards = torch.tensor(scores, dtype=torch.float32).view(len(names), len(prompts), g).transpose(0, 1)
    trajectories, cursor = {}, iter(scores)
    for name in names:
        trajectories[name] = [
            Trajectory.from_completion(c, prompt_id=p.id, source=name, prompt_text=p.question, reward=next(cursor),
                                       policy_version=step, max_response_len=max_response_len)
            for p, group in zip(prompts, completions[name]) for c in group
        ]
    return StepData(prompts=prompts, trajectories=trajectories, rewards=rewards.contiguous())


def views_to_batch(views: list[LearnerView], loss_inputs: LossInputs | None = None) -> SequenceBatch:
    return SequenceBatch(
        input_ids=tuple(torch.tensor(v.input_ids, dtype=torch.long) for v in views),
        prompt_lens=torch.tensor([v.prompt_len for v in views], dtype=torch.long),
        loss_inputs=loss_inputs,
    )


def prompt_id_map(rt: AgentRuntime, prompts: list[PromptRecord]) -> dict[str, list[int]]:
    return {p.id: rt.prompt_ids(p.question) for p in prompts}


@dataclass
class _OwnPass:
    """One agent's forward passes over its own responses (:func:`old_logprobs`)."""

    sums: list[float]
    lens: list[int]
    token_logps: list[torch.Tensor] | None = None
    reference: list[torch.Tensor] | None = None


def old_logprobs(runtimes: list[AgentRuntime], data: StepData, exchange: Exchange, algorithm: Algorithm,
                 temperature: float, cross: bool = True) -> None:
    """Fill each trajectory's Σ log π^(j)_old and L_j with its source's trainer forward (docs/algorithm.md §3),
    and the extra passes ``algorithm.passes`` asks for into ``data.passes``.

    Runs before any update of the step, at the rollout temperature; agents whose trainers run elsewhere
    (Ray) compute at the same time. A view with no response token (``strip_all`` on an answer that was
    only an EOS) gets Σ = 0 over L = 0 tokens and is left out of training. Mutates ``data`` in place
    (trajectories are frozen: they are replaced). ``cross=False`` leaves the learners' pass over the other
    agents' responses to a later :func:`learner_old_on_others` (a job whose peers' responses arrive after
    its own pass, trainer/peers.py).
    """
    passes = algorithm.passes
    views = {rt.name: exchange.views(rt.name, data.trajectories[rt.name], prompt_id_map(rt, data.prompts),
                                     record_stats=False) for rt in runtimes}
    trainer_elsewhere = lambda rt: runs_in_process(rt.trainer)  # noqa: E731
    own = for_each(runtimes, lambda rt: _own_pass(rt, views[rt.name], algorithm, temperature), trainer_elsewhere)
    for rt, found in zip(runtimes, own):
        data.trajectories[rt.name] = [t.with_logp(s, n)
                                      for t, s, n in zip(data.trajectories[rt.name], found.sums, found.lens)]
        if found.token_logps is not None:
            data.passes.source_token_logps[rt.name] = found.token_logps
        if found.reference is not None:
            data.passes.reference_on_self[rt.name] = found.reference
    if passes.learner_old_on_others and cross:
        learner_old_on_others(runtimes, runtimes, data, exchange, temperature)


def learner_old_on_others(learners: list[AgentRuntime], agents: list, data: StepData, exchange: Exchange,
                          temperature: float) -> None:
    """Each learner's Σ log π_old over the other ``agents``' responses in ``data`` into
    ``data.passes.learner_old_on_others``; learners whose trainers run elsewhere compute at once."""
    found = for_each(learners, lambda rt: learner_cross_logprobs(rt, agents, data, exchange, temperature),
                     lambda rt: runs_in_process(rt.trainer))
    data.passes.learner_old_on_others.update({rt.name: part for rt, part in zip(learners, found)})


def _own_pass(rt: AgentRuntime, views: list[LearnerView], algorithm: Algorithm, temperature: float) -> _OwnPass:
    """Agent ``rt``'s π_old (and, where asked for, per-token and reference) pass over its own views."""
    keep = [i for i, v in enumerate(views) if v.response_len > 0]
    batch = views_to_batch([views[i] for i in keep])
    found = _OwnPass([0.0] * len(views), [0] * len(views))
    if algorithm.passes.source_token_logps:
        out = rt.trainer.token_logprobs(batch, temperature) if keep else None
        found.token_logps = _scatter(_per_sequence(out) if out else [], keep, len(views))
        sums, lens = (out.seq_logp_sum, out.seq_len) if out else ([], [])
    else:
        sums, lens = rt.trainer.sequence_logprobs(batch, temperature) if keep else ([], [])
    for i, s, n in zip(keep, sums, lens):
        found.sums[i], found.lens[i] = float(s), int(n)
    if algorithm.passes.reference_on_self:
        ref = _per_sequence(rt.trainer.reference_token_logprobs(batch, temperature)) if keep else []
        found.reference = _scatter(ref, keep, len(views))
    return found


def behaviour_logprobs(runtimes: list[AgentRuntime], prompts: list[PromptRecord],
                       completions: dict[str, list[list[Completion]]], exchange: Exchange, versions: dict[str, int],
                       current: int, temperature: float, max_response_len: int) -> dict[str, list[float]]:
    """Σ log π_behav of each agent's own responses under the weight snapshot that sampled them
    (docs/algorithm.md §7b), for the agents whose ``versions`` lag behind ``current``: name → [P·G]
    (0 for a view with no response token). Agents whose trainers run elsewhere compute at once."""
    stale = [rt for rt in runtimes if versions[rt.name] < current]

    def one(rt: AgentRuntime) -> list[float]:
        trajs = [Trajectory.from_completion(c, prompt_id=p.id, source=rt.name, prompt_text=p.question, reward=0.0,
                                            max_response_len=max_response_len)
                 for p, group in zip(prompts, completions[rt.name]) for c in group]
        views = exchange.views(rt.name, trajs, prompt_id_map(rt, prompts), record_stats=False)
        keep = [i for i, v in enumerate(views) if v.response_len > 0]
        sums = [0.0] * len(views)
        if keep:
            found, _ = rt.trainer.sequence_logprobs_at(versions[rt.name], views_to_batch([views[i] for i in keep]),
                                                     temperature)
            for i, value in zip(keep, found.tolist()):
                sums[i] = float(value)
        return sums

    done = for_each(stale, one, lambda rt: runs_in_process(rt.trainer))
    return {rt.name: sums for rt, sums in zip(stale, done)}


def _scatter(values: list[torch.Tensor], keep: list[int], size: int) -> list[torch.Tensor]:
    """``values`` of the non-empty views at positions ``keep``; an empty [0] tensor for the others."""
    out = [torch.zeros(0)] * size
    for i, value in zip(keep, values, strict=True):
        out[i] = value
    return out


def learner_cross_logprobs(rt: AgentRuntime, runtimes: list, data: StepData, exchange: Exchange,
                           temperature: float) -> dict[str, torch.Tensor]:
    """Σ log π^(k)_old of learner k over every other agent's responses, re-tokenized as in its learner
    batch, before any update (docs/algorithm.md §5d, §8): source name → [P·G] float64, one forward pass
    (0 for a view with no response token, which training leaves out). ``runtimes``: the run's agents
    (anything with ``name`` and ``index``); those without responses in ``data`` are skipped."""
    others = [src for src in runtimes if src.index != rt.index and src.name in data.trajectories]
    trajs = [t for src in others for t in data.trajectories[src.name]]
    views = exchange.views(rt.name, trajs, prompt_id_map(rt, data.prompts), record_stats=False)
    keep = [i for i, v in enumerate(views) if v.response_len > 0]
    sums = torch.zeros(len(views), dtype=torch.float64)
    if keep:
        found, _ = rt.trainer.sequence_logprobs(views_to_batch([views[i] for i in keep]), temperature)
        sums[torch.tensor(keep, dtype=torch.long)] = torch.as_tensor(found, dtype=torch.float64).cpu()
    counts = [len(data.trajectories[src.name]) for src in others]
    return {src.name: part for src, part in zip(others, torch.split(sums, counts))}


def _learner_old_logps(data: StepData, learner: str, source: str) -> torch.Tensor:
    """[P·G] Σ log π^(learner)_old over ``source``'s responses, as :func:`old_logprobs` left them."""
    found = data.passes.learner_old_on_others.get(learner, {}).get(source)
    if found is None:
        raise ValueError(f"no π_old of learner {learner!r} on agent {source!r}'s responses, which this algorithm "
                         "needs (StepPasses.learner_old_on_others); run stages.old_logprobs on this step first")
    return found


def _reference_logps(data: StepData, learner: str) -> list[torch.Tensor]:
    """Per-token reference log-probs of ``learner``'s own responses, as :func:`old_logprobs` left them."""
    found = data.passes.reference_on_self.get(learner)
    if found is None:
        raise ValueError(f"no reference log-probs of agent {learner!r}'s own responses, which the KL penalty needs "
                         "(hacpo.kl_coef > 0); run stages.old_logprobs on this step first")
    return found


def task_families(task: object) -> tuple[str, ...]:
    """The problem families of ``task`` (``add_sub_cot``: ``("add", "sub")``); () for a task without families."""
    return tuple(getattr(task, "families", ()))


def prompt_family_index(task: object, prompts: list[PromptRecord]) -> torch.Tensor | None:
    """[P] int64: each prompt's family as an index into ``task.families`` (−1: a prompt of none); None for a task
    without families (the per-family metrics of docs/algorithm.md §10b)."""
    families = task_families(task)
    if not families:
        return None
    named = [task.family_of(p) for p in prompts]  # type: ignore[attr-defined]
    return torch.tensor([families.index(f) if f in families else -1 for f in named], dtype=torch.long)


def learner_batch(rt: AgentRuntime, runtimes: list, data: StepData, exchange: Exchange,
                  omega: torch.Tensor, algorithm: Algorithm, centers: torch.Tensor | None = None,
                  prompt_families: torch.Tensor | None = None) -> SequenceBatch:
    """Learner k's step batch: the responses of ``algorithm.sources(k)`` (those ``algorithm.trains_on`` keeps)
    with per-sequence advantages
    (eq. 6-7), is_self, discrepancy ω^(j,k) (eq. 10), source statistics (eq. 11), source index and, with
    ``centers`` ([n, n] float64 c[k, j] of :meth:`Algorithm.cross_centers`), the adaptive window's centre
    of each sequence's pair (docs/algorithm.md §5b); plus what ``algorithm.passes`` computed. ``runtimes``:
    every agent of the run in config order (anything with ``name`` and ``index``: a peer job's agent is a
    :class:`~hacrl_megatron.trainer.peers.PeerAgent` whose responses ``data`` holds as text).
    ``prompt_families`` ([P] int64 of :func:`prompt_family_index`): each sequence's family, for the per-family
    metrics (LossInputs.family_index)."""
    sources = [runtimes[i] for i in algorithm.sources(rt.index)]
    adv = algorithm.advantages(data.rewards, rt.index, omega)
    trained = algorithm.trains_on(data.rewards, rt.index)  # [P, len(sources), G] or None: every response
    passes = algorithm.passes
    trajs: list[Trajectory] = []
    parts: dict[str, list[torch.Tensor]] = {"advantages": [], "is_self": [], "discrepancy": [],
                                            "source_logp_sum": [], "source_len": [], "source_index": [],
                                            "cross_center": [], "learner_old_logp_sum": [], "behaviour_log_ratio": [],
                                            "family_index": []}
    behaviour = data.passes.behaviour_on_self  # §7b: batches older than the learners' weights
    old_tokens: list[torch.Tensor] = []
    ref_tokens: list[torch.Tensor] = []  # the KL's reference on self rows; cross rows stay empty (zeros once padded)
    for pos, src in enumerate(sources):
        src_trajs = data.trajectories[src.name]
        trajs.extend(src_trajs)
        parts["advantages"].append(adv[:, pos, :].reshape(-1).float())
        parts["is_self"].append(torch.full((len(src_trajs),), src.index == rt.index))
        parts["discrepancy"].append(torch.full((len(src_trajs),), float(omega[src.index, rt.index])))
        proximal = torch.tensor([t.source_logp_sum for t in src_trajs])
        lens = torch.tensor([t.source_len for t in src_trajs], dtype=torch.long)
        behav = behaviour.get(src.name)
        if behaviour:  # a self row keeps π_prox and is weighted by π_prox/π_behav; a cross row's ratio is to π_behav
            log_w = (proximal.double() - behav) / lens.clamp(min=1) if behav is not None else torch.zeros(len(lens))
            parts["behaviour_log_ratio"].append(log_w.double() if src.index == rt.index
                                                else torch.zeros(len(lens), dtype=torch.float64))
            if behav is not None and src.index != rt.index:
                proximal = behav.to(proximal.dtype)
        parts["source_logp_sum"].append(proximal)
        if passes.learner_old_on_others:  # a self response's π_old is the learner's own
            parts["learner_old_logp_sum"].append(parts["source_logp_sum"][-1].double() if src.index == rt.index
                                                 else _learner_old_logps(data, rt.name, src.name))
        parts["source_len"].append(lens)
        parts["source_index"].append(torch.full((len(src_trajs),), src.index, dtype=torch.long))
        center = 0.0 if centers is None or src.index == rt.index else float(centers[rt.index, src.index])
        parts["cross_center"].append(torch.full((len(src_trajs),), center, dtype=torch.float64))
        if prompt_families is not None and data.prompts:  # trajectories are prompt-major: each prompt's G responses in a row
            parts["family_index"].append(prompt_families.repeat_interleave(len(src_trajs) // len(data.prompts)))
        if src.index == rt.index:
            old_tokens.extend(data.passes.source_token_logps.get(src.name, []))
        elif passes.source_token_logps:  # a cross row's per-token π_old is its author's, in its author's tokens:
            old_tokens.extend([torch.zeros(0)] * len(src_trajs))  # no use to the learner (zeros once padded)
        if passes.reference_on_self:
            ref_tokens.extend(_reference_logps(data, rt.name) if src.index == rt.index
                              else [torch.zeros(0)] * len(src_trajs))
    views = exchange.views(rt.name, trajs, prompt_id_map(rt, data.prompts))
    fields = {k: torch.cat(v) if v else None for k, v in parts.items()}
    if centers is None:
        fields["cross_center"] = None
    old = torch.nn.utils.rnn.pad_sequence(old_tokens, batch_first=True) if old_tokens else None
    ref = torch.nn.utils.rnn.pad_sequence(ref_tokens, batch_first=True) if ref_tokens else None
    inputs = LossInputs(**fields, old_token_logp=old, ref_token_logp=ref)
    wanted = (torch.cat([trained[:, pos, :].reshape(-1) for pos in range(len(sources))]).tolist()
              if trained is not None else [True] * len(trajs))
    keep = [i for i, v in enumerate(views) if v.response_len > 0 and trajs[i].source_len > 0 and wanted[i]]
    views = [views[i] for i in keep]  # an empty view ("no_eos" on an empty answer) has nothing to learn
    return views_to_batch(views, inputs.select(torch.tensor(keep, dtype=torch.long)))


def split_mini_batches(batch: SequenceBatch, num: int, seed: int, order: str = "shuffle") -> list[SequenceBatch]:
    """Split the learner's step batch into ``num`` near-equal mini-batches (docs/algorithm.md §7), after
    ``order`` (``train.minibatch_order``): ``shuffle`` (seeded), or ``self_first`` (the learner's own responses,
    then the others', each in batch order, unshuffled: cross samples meet the later, tighter windows of eq. 14)."""
    if order == "self_first":
        own = _required_inputs(batch).is_self
        index = torch.cat([torch.nonzero(own).flatten(), torch.nonzero(~own).flatten()])
    else:
        index = torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed))
    return [batch.select(chunk) for chunk in torch.tensor_split(index, num) if chunk.numel()]


def _required_inputs(batch: SequenceBatch) -> LossInputs:
    if batch.loss_inputs is None:
        raise ValueError("train.minibatch_order=self_first needs the batch's loss_inputs (which rows are self)")
    return batch.loss_inputs


def reward_metrics(data: StepData, agents: list, prompt_families: torch.Tensor | None = None,
                   families: tuple[str, ...] = ()) -> dict[str, float]:
    """Per agent (anything with ``name`` and ``index``, its column of ``data.rewards``): mean reward,
    truncated share, mean response tokens, mean π_old log-prob per token; with ``prompt_families`` ([P] int64
    of :func:`prompt_family_index`, into ``families``) also the mean reward on each family's prompts of the
    step, ``<agent>/reward/<family>/mean`` (the per-family capability beside ω of eq. 10)."""
    out = {}
    for agent in agents:
        name = agent.name
        r = data.rewards[:, agent.index]
        trajs = data.trajectories[name]
        out[f"{name}/reward_mean"] = float(r.mean()) if r.numel() else 0.0
        if prompt_families is not None:
            for f, family in enumerate(families):
                rows = r[prompt_families == f]
                if rows.numel():
                    out[f"{name}/reward/{family}/mean"] = float(rows.mean())
        out[f"{name}/truncated_frac"] = sum(t.finish_reason == "length" for t in trajs) / max(len(trajs), 1)
        out[f"{name}/response_tokens_mean"] = sum(t.num_tokens for t in trajs) / max(len(trajs), 1)
        logps = [t.source_logp_sum / t.source_len for t in trajs if t.source_len > 0 and not math.isnan(t.source_logp_sum)]
        out[f"{name}/old_logp_per_token"] = sum(logps) / max(len(logps), 1)
    return out
