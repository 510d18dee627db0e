"""The stages of one HACRL step, one function each (docs/architecture.md, data flow).

rollout → verify → old log-probs → learner views + advantages → loss function. The loop in
``loop.py`` calls them in order; each is testable alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hacrl_megatron.agents.batch import LogProbOutput, LossFn, MiniBatchInfo, SequenceBatch
from hacrl_megatron.algo import (
    CapabilityTracker,
    LossInputs,
    adaptive_center,
    broadcast_to_tokens,
    capability_aware_advantages,
    grpo_token_loss,
    hacpo_loss,
)
from hacrl_megatron.config import ExperimentConfig, HACPOConfig
from hacrl_megatron.data.records import PromptRecord
from hacrl_megatron.exchange.records import LearnerView, Trajectory
from hacrl_megatron.exchange.retokenize import Exchange
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.reward.verify import RewardRequest
from hacrl_megatron.rollout.types import Completion, SamplingParams
from hacrl_megatron.trainer.runtime import AgentRuntime

SHARED_ALGORITHMS = ("hacpo", "naive")
PAIR_METRICS = ("cross_clipfrac", "cross_center", "cross_log_ratio_median")  # keyed by source index in algo/


def shares_rollouts(cfg: HACPOConfig) -> bool:
    """HACPO and Naive learn from every agent's responses; GSPO, GSPO×2, GRPO from their own only."""
    return cfg.algorithm in SHARED_ALGORITHMS


def samples_per_prompt(exp: ExperimentConfig) -> int:
    """G, doubled for the resource-equivalent GSPO×2 baseline (docs/algorithm.md §8)."""
    g = exp.rollout.samples_per_prompt
    return 2 * g if exp.hacpo.algorithm == "gspo_x2" else g


def step_seed(exp: ExperimentConfig, step: int, salt: int) -> int:
    """A seed that depends only on (run seed, step, salt): resumed runs sample identically."""
    return (exp.train.seed * 1_000_003 + step * 7919 + salt * 104_729) % (2**31 - 1)


@dataclass
class StepData:
    """Everything sampled and scored in one step. ``trajectories[a]`` is agent a's, prompt-major [P·G]."""

    prompts: list[PromptRecord]
    trajectories: dict[str, list[Trajectory]]
    rewards: torch.Tensor  # [P, n, G] float32, agents in config order
    old_token_logps: dict[str, list[torch.Tensor]]  # GRPO only: per trajectory, source tokens
    # cross_clip_mode=decoupled only: learner → source → [P·G] Σ log π^(learner)_old in the learner's tokens
    learner_old_logps: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def rollout(runtimes: list[AgentRuntime], prompts: list[PromptRecord], exp: ExperimentConfig,
            step: int) -> dict[str, list[list[Completion]]]:
    """Every agent samples G responses per prompt with its pre-step weights: name → [P][G] Completion."""
    r = exp.rollout
    out = {}
    for rt in runtimes:
        params = SamplingParams(n=samples_per_prompt(exp), temperature=r.temperature, top_p=r.top_p,
                                max_new_tokens=r.max_response_len, seed=step_seed(exp, step, rt.index))
        out[rt.name] = rt.engine.generate([rt.prompt_ids(p.question) for p in prompts], params)
    return out


def verify(verifier: VerifierPool, prompts: list[PromptRecord], completions: dict[str, list[list[Completion]]],
           step: int, max_response_len: int) -> StepData:
    """Score every response once with the shared verifier; the reward is shared by all learners."""
    names = list(completions)
    requests = [RewardRequest(p.kind, c.text, p.answer)
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
    return StepData(prompts=prompts, trajectories=trajectories, rewards=rewards.contiguous(), old_token_logps={})


def views_to_batch(views: list[LearnerView], loss_inputs: LossInputs | None = None) -> SequenceBatch:
    return SequenceBatch(
        input_ids=tuple(torch.tensor(v.input_ids, dtype=torch.long) for v in views),
        prompt_lens=torch.tensor([v.prompt_len for v in views], dtype=torch.long),
        loss_inputs=loss_inputs,
    )


def prompt_id_map(rt: AgentRuntime, prompts: list[PromptRecord]) -> dict[str, list[int]]:
    return {p.id: rt.prompt_ids(p.question) for p in prompts}


def old_logprobs(runtimes: list[AgentRuntime], data: StepData, exchange: Exchange, exp: ExperimentConfig) -> None:
    """Fill each trajectory's Σ log π^(j)_old and L_j with its source's trainer forward (docs/algorithm.md §3).

    Runs before any update of the step, at the rollout temperature. GRPO also keeps the per-token
    values. Mutates ``data`` in place (trajectories are frozen: they are replaced).
    """
    for rt in runtimes:
        trajs = data.trajectories[rt.name]
        views = exchange.views(rt.name, trajs, prompt_id_map(rt, data.prompts), record_stats=False)
        batch = views_to_batch(views)
        if exp.hacpo.algorithm == "grpo":
            out = rt.agent.token_logprobs(batch, exp.rollout.temperature)
            data.old_token_logps[rt.name] = [out.token_logps[out.cu_seqlens[i]:out.cu_seqlens[i + 1]]
                                             for i in range(len(views))]
            sums, lens = out.seq_logp_sum, out.seq_len
        else:
            sums, lens = rt.agent.sequence_logprobs(batch, exp.rollout.temperature)
        data.trajectories[rt.name] = [t.with_logp(float(s), int(n)) for t, s, n in zip(trajs, sums, lens)]
    if needs_learner_old_logps(exp.hacpo):
        for rt in runtimes:
            data.learner_old_logps[rt.name] = learner_cross_logprobs(rt, runtimes, data, exchange, exp)


def needs_learner_old_logps(cfg: HACPOConfig) -> bool:
    """The decoupled cross objective also needs each learner's own π_old on the others' responses (§5d)."""
    return cfg.algorithm == "hacpo" and cfg.cross_clip_mode == "decoupled"


def learner_cross_logprobs(rt: AgentRuntime, runtimes: list[AgentRuntime], data: StepData, exchange: Exchange,
                           exp: ExperimentConfig) -> dict[str, torch.Tensor]:
    """Σ log π^(k)_old of learner k over every other agent's responses, re-tokenized as in its learner
    batch, before any update (docs/algorithm.md §5d): source name → [P·G] float64, one forward pass."""
    others = [src for src in runtimes if src.index != rt.index]
    trajs = [t for src in others for t in data.trajectories[src.name]]
    views = exchange.views(rt.name, trajs, prompt_id_map(rt, data.prompts), record_stats=False)
    sums, _ = rt.agent.sequence_logprobs(views_to_batch(views), exp.rollout.temperature)
    sums = torch.as_tensor(sums, dtype=torch.float64).cpu()
    counts = [len(data.trajectories[src.name]) for src in others]
    return {src.name: part for src, part in zip(others, torch.split(sums, counts))}


def _learner_old_logps(data: StepData, learner: str, source: str) -> torch.Tensor:
    """[P·G] Σ log π^(learner)_old over ``source``'s responses, as :func:`old_logprobs` left them."""
    found = data.learner_old_logps.get(learner, {}).get(source)
    if found is None:
        raise ValueError(f"hacpo.cross_clip_mode=decoupled: no π_old of learner {learner!r} on the other agents' "
                         "responses; run stages.old_logprobs on this step first")
    return found


def learner_batch(rt: AgentRuntime, runtimes: list[AgentRuntime], data: StepData, exchange: Exchange,
                  omega: torch.Tensor, exp: ExperimentConfig, centers: torch.Tensor | None = None) -> SequenceBatch:
    """Learner k's step batch: own responses (+ every other agent's when sharing) with per-sequence
    advantages (eq. 6-7), is_self, discrepancy ω^(j,k) (eq. 10), source statistics (eq. 11), source
    index and, with ``centers`` ([n, n] float64 c[k, j] of :func:`cross_centers`), the adaptive
    window's centre of each sequence's pair (docs/algorithm.md §5b)."""
    h = exp.hacpo
    sources = [r for r in runtimes if shares_rollouts(h) or r.index == rt.index]
    if shares_rollouts(h):
        rewards, learner_pos, omega_used = data.rewards, rt.index, omega
    else:
        rewards = data.rewards[:, rt.index: rt.index + 1]
        learner_pos, omega_used = 0, torch.ones(1, 1, dtype=torch.float64)
    adv = capability_aware_advantages(
        rewards, learner_pos, omega_used,
        capability_aware=h.capability_aware_advantage and h.algorithm != "naive",
        uniform_guard=h.uniform_guard, baseline_guard=h.baseline_guard, max_reward=h.max_reward,
    )
    trajs: list[Trajectory] = []
    parts: dict[str, list[torch.Tensor]] = {"advantages": [], "is_self": [], "discrepancy": [],
                                            "source_logp_sum": [], "source_len": [], "source_index": [],
                                            "cross_center": []}
    old_tokens: list[torch.Tensor] = []
    needs_old, learner_old = needs_learner_old_logps(h), []  # decoupled only (§5d)
    for pos, src in enumerate(sources):
        src_trajs = data.trajectories[src.name]
        trajs.extend(src_trajs)
        parts["advantages"].append(adv[:, pos, :].reshape(-1).float())
        parts["is_self"].append(torch.full((len(src_trajs),), src.index == rt.index))
        parts["discrepancy"].append(torch.full((len(src_trajs),), float(omega[src.index, rt.index])))
        parts["source_logp_sum"].append(torch.tensor([t.source_logp_sum for t in src_trajs]))
        if needs_old:  # a self response's π_old is the learner's own
            learner_old.append(parts["source_logp_sum"][-1] if src.index == rt.index
                               else _learner_old_logps(data, rt.name, src.name))
        parts["source_len"].append(torch.tensor([t.source_len for t in src_trajs], dtype=torch.long))
        parts["source_index"].append(torch.full((len(src_trajs),), src.index, dtype=torch.long))
        center = 0.0 if centers is None or src.index == rt.index else float(centers[rt.index, src.index])
        parts["cross_center"].append(torch.full((len(src_trajs),), center, dtype=torch.float64))
        old_tokens.extend(data.old_token_logps.get(src.name, []))
    views = exchange.views(rt.name, trajs, prompt_id_map(rt, data.prompts))
    old = torch.nn.utils.rnn.pad_sequence(old_tokens, batch_first=True) if old_tokens else None
    fields = {k: torch.cat(v) for k, v in parts.items()}
    if centers is None:
        fields["cross_center"] = None
    fields["learner_old_logp_sum"] = torch.cat([part.double() for part in learner_old]) if needs_old else None
    inputs = LossInputs(**fields, old_token_logp=old)
    keep = [i for i, v in enumerate(views) if v.response_len > 0 and trajs[i].source_len > 0]
    views = [views[i] for i in keep]  # an empty view ("no_eos" on an empty answer) has nothing to learn
    return views_to_batch(views, inputs.select(torch.tensor(keep, dtype=torch.long)))


def cross_centers(tracker: CapabilityTracker, exp: ExperimentConfig) -> torch.Tensor | None:
    """c[k, j] [n, n] float64, the adaptive window's centre of every learner-source pair from the
    tracker's running medians (docs/algorithm.md §5b); None for the fixed window or a non-HACPO method."""
    h = exp.hacpo
    if h.cross_window == "fixed" or h.algorithm != "hacpo":
        return None
    n = len(exp.agents)
    return torch.tensor([[0.0 if k == j else adaptive_center(tracker.median_log_ratio(k, j), h) for j in range(n)]
                         for k in range(n)], dtype=torch.float64)


def record_cross_statistics(tracker: CapabilityTracker, metrics: dict[str, float], exp: ExperimentConfig) -> None:
    """Feed this step's per-pair median log s (``<k>/hacpo/cross_log_ratio_median/<j>``, the mean over
    the step's micro-batches) into the tracker's running window; pairs without cross samples are skipped."""
    if exp.hacpo.cross_window == "fixed" or exp.hacpo.algorithm != "hacpo":
        return
    names = [a.name for a in exp.agents]
    for k, learner in enumerate(names):
        for j, source in enumerate(names):
            value = metrics.get(f"{learner}/hacpo/cross_log_ratio_median/{source}")
            if k != j and value is not None:
                tracker.record_log_ratio(k, j, value)


def name_pair_metrics(metrics: dict[str, float], names: list[str]) -> dict[str, float]:
    """``cross_clipfrac/<j>/pos`` → ``cross_clipfrac/<name of agent j>/pos`` (and the other per-pair keys)."""
    out = {}
    for key, value in metrics.items():
        head, sep, rest = key.partition("/")
        if sep and head in PAIR_METRICS:
            index, _, tail = rest.partition("/")
            key = "/".join(p for p in (head, names[int(index)], tail) if p)
        out[key] = value
    return out


def split_mini_batches(batch: SequenceBatch, num: int, seed: int) -> list[SequenceBatch]:
    """Shuffle the learner's step batch and split it into ``num`` near-equal mini-batches (docs/algorithm.md §7)."""
    order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed))
    return [batch.select(chunk) for chunk in torch.tensor_split(order, num) if chunk.numel()]


def make_loss_fn(exp: ExperimentConfig) -> LossFn:
    """The learner's LossFn: HACPO / GSPO / Naive sequence objective, or GRPO's token objective."""
    h = exp.hacpo

    names = [a.name for a in exp.agents]

    def sequence_loss(out: LogProbOutput, inputs: LossInputs | None,
                      info: MiniBatchInfo) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = hacpo_loss(out.seq_logp_sum, out.seq_len, _required(inputs), info.update_index, h,
                                   num_sequences=info.num_sequences)
        return loss, name_pair_metrics(metrics, names)

    def grpo_loss(out: LogProbOutput, inputs: LossInputs | None,
                  info: MiniBatchInfo) -> tuple[torch.Tensor, dict[str, float]]:
        inputs = _required(inputs)
        if inputs.old_token_logp is None:
            raise ValueError("GRPO's loss needs LossInputs.old_token_logp (the per-token log π_old)")
        old = torch.cat([inputs.old_token_logp[i, :n] for i, n in enumerate(out.seq_len.tolist())])
        token_adv = broadcast_to_tokens(inputs.advantages, out.cu_seqlens)
        return grpo_token_loss(out.token_logps, old, token_adv, clip_low=h.grpo_clip_low,
                               clip_high=h.grpo_clip_high, num_tokens=info.num_tokens)

    return grpo_loss if h.algorithm == "grpo" else sequence_loss


def _required(inputs: LossInputs | None) -> LossInputs:
    if inputs is None:
        raise ValueError("the RL loss needs the batch's loss_inputs (built by learner_batch); got None")
    return inputs


def reward_metrics(data: StepData, names: list[str]) -> dict[str, float]:
    out = {}
    for i, name in enumerate(names):
        r = data.rewards[:, i]
        trajs = data.trajectories[name]
        out[f"{name}/reward_mean"] = float(r.mean()) if r.numel() else 0.0
        out[f"{name}/truncated_frac"] = sum(t.finish_reason == "length" for t in trajs) / max(len(trajs), 1)
        out[f"{name}/response_tokens_mean"] = sum(len(t.token_ids) for t in trajs) / max(len(trajs), 1)
        logps = [t.source_logp_sum / t.source_len for t in trajs if t.source_len > 0 and not math.isnan(t.source_logp_sum)]
        out[f"{name}/old_logp_per_token"] = sum(logps) / max(len(logps), 1)
    return out
