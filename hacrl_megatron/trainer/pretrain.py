"""Supervised warm-up (`hacrl pretrain`): bring randomly initialised agents to partial competence.

RL from a random policy never sees a reward on a verifiable task, so the CPU demo first trains
each agent on correct answers (``task.sft_target``) until its greedy accuracy reaches
``warmup_sft_target`` (docs/measured.md §8: a threshold, not a fixed step count, because a small
model's accuracy jumps abruptly). The result is an HF checkpoint cached under
``$HACRL_CACHE`` (default ``~/.cache/hacrl_megatron``)/warmup/<agent>-<hash of everything that
shapes it>, so `hacrl train` reuses it.

Shipped warm-ups: the package carries the warm-up of the default demo's agents
(``hacrl_megatron/presets/warmup/<agent>-<hash>``, written by ``tools/ship_warmup.py`` with this
module's own :func:`warm_up_agent`), so a first ``hacrl train`` skips the supervised phase. They are
used only when the hash (the same key as the cache) matches exactly; any change of model,
tokenizer, schedule, task or seed falls back to training, and ``hacrl pretrain --force`` always
trains. ``tests/e2e/test_shipped_warmup.py`` checks the shipped weights still reach their thresholds
and regenerates them (slow).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from hacrl_megatron.agents.batch import LogProbOutput, MiniBatchInfo, SequenceBatch
from hacrl_megatron.algo import LossInputs
from hacrl_megatron.config import AgentConfig, ExperimentConfig
from hacrl_megatron.config.schema import MOE_ARCHS, MOE_MODEL_FIELDS
from hacrl_megatron.data import DatasetTask, PromptRecord, Task, make_task
from hacrl_megatron.data.formats import dataset_options
from hacrl_megatron.models.dtype import resolve_model_dtype
from hacrl_megatron.paths import atomic_save_dir, default_cache_dir
from hacrl_megatron.reward.custom import custom_score_fn
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.trainer.evaluation import evaluate_agents
from hacrl_megatron.trainer.runtime import AgentRuntime, build_runtime, configure_process

logger = logging.getLogger(__name__)

EVAL_EVERY = 20  # default warm-up updates between accuracy checks (agents.*.warmup_sft_eval_every)
EVAL_ITEMS = 100


SHIPPED_DIR = Path(__file__).resolve().parents[1] / "presets" / "warmup"
INFO_FILE = "warmup.json"


def needs_warmup(exp: ExperimentConfig, agent: AgentConfig) -> bool:
    return exp.train.sft_warmup and agent.init_checkpoint is None and agent.model.hf_path is None


def warmup_dir(exp: ExperimentConfig, index: int) -> Path:
    """Cache folder of agent ``index``'s warm-up (``<cache>/warmup/<warmup_key>``)."""
    return default_cache_dir() / "warmup" / warmup_key(exp, index)


def shipped_warmup(exp: ExperimentConfig, index: int) -> Path | None:
    """The warm-up of agent ``index`` shipped with the package for exactly this key, else None."""
    path = SHIPPED_DIR / warmup_key(exp, index)
    return path if (path / INFO_FILE).is_file() else None


def warmup_key(exp: ExperimentConfig, index: int) -> str:
    """``<agent name>-<12 hex digits>``: the name of agent ``index``'s warm-up folder.

    The hash covers exactly what shapes the warm-up weights (architecture, tokenizer, prompt
    template, backend numerics, warm-up schedule, task and data, seeds), not unrelated fields such
    as the RL learning rate or the rollout GPUs, so adding config fields never orphans a cache.
    """
    agent = exp.agents[index]
    model = dataclasses.asdict(agent.model)
    # the dtype the warm-up trains in: a warm-up starts from sizes, so model.dtype=auto is float32 (models/dtype.py)
    model["dtype"] = resolve_model_dtype(agent.model.dtype, checkpoint=None, backend=agent.backend)
    if agent.model.arch not in MOE_ARCHS:  # meaningless for dense models: their keys stay what they were
        model = {k: v for k, v in model.items() if k not in MOE_MODEL_FIELDS}
    key = {
        "model": model, "tokenizer": agent.tokenizer,
        "prompt_template": agent.prompt_template, "backend": agent.backend,
        "sft": [agent.warmup_sft_lr, agent.warmup_sft_target, agent.warmup_sft_max_steps, agent.warmup_sft_batch],
        "task": [exp.data.task, exp.data.difficulty, exp.data.seed, exp.data.path],
        "seed": exp.train.seed, "index": index, "max_response_len": exp.rollout.max_response_len,
    }
    if exp.data.checker is not None:  # a user's checker decides when the warm-up stops
        key["checker"] = exp.data.checker
    if agent.warmup_sft_eval_every != EVAL_EVERY:  # where the run stops; the default leaves older keys alone
        key["eval_every"] = agent.warmup_sft_eval_every
    if agent.warmup_sft_families:  # a mixture of the task's families (trains and checks on it)
        key["families"] = dict(sorted(agent.warmup_sft_families.items()))
    if agent.warmup_sft_from is not None:  # a later snapshot of another agent's run: that run is part of the key
        key["trajectory"] = warmup_key(exp, lead_index(exp, index))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return f"{agent.name}-{digest}"


def lead_index(exp: ExperimentConfig, index: int) -> int:
    """Index of the agent whose warm-up run makes agent ``index``'s snapshot (itself unless ``warmup_sft_from``)."""
    lead = exp.agents[index].warmup_sft_from
    return index if lead is None else next(i for i, a in enumerate(exp.agents) if a.name == lead)


def sft_loss(out: LogProbOutput, inputs: LossInputs | None, info: MiniBatchInfo) -> tuple[torch.Tensor, dict[str, float]]:
    """−mean over sequences of the per-token mean log-likelihood of the target response (a LossFn;
    SFT batches carry no loss inputs)."""
    per_token = out.seq_logp_sum / out.seq_len
    return -per_token.sum() / info.num_sequences, {"nll_per_token": float(-per_token.detach().mean())}


def sft_batch(rt: AgentRuntime, task: Task, records: list[PromptRecord]) -> SequenceBatch:
    """Prompt (agent's template) + target answer + the agent's eos, one sequence per record."""
    eos = rt.tokenizer.eos_token_id
    seqs, prompt_lens = [], []
    for rec in records:
        prompt = rt.prompt_ids(rec.question)
        answer = rt.tokenizer(task.sft_target(rec), add_special_tokens=False)["input_ids"]
        seqs.append(torch.tensor(prompt + list(answer) + [eos], dtype=torch.long))
        prompt_lens.append(len(prompt))
    return SequenceBatch(tuple(seqs), torch.tensor(prompt_lens, dtype=torch.long))


def warm_up_agent(exp: ExperimentConfig, index: int, out_dir: Path, verifier: VerifierPool) -> dict[str, Any]:
    """Train agent ``index`` by SFT until its greedy accuracy reaches the target; save HF weights."""
    return warm_up_run(exp, [(index, out_dir)], verifier)[exp.agents[index].name]


def warm_up_run(exp: ExperimentConfig, snapshots: list[tuple[int, Path]], verifier: VerifierPool) -> dict[str, dict]:
    """One SFT run of the lead agent of ``snapshots`` (agent indices sharing one :func:`lead_index`), saving
    each agent's snapshot to its folder at the first check where greedy accuracy reaches its
    ``warmup_sft_target`` (or at its ``warmup_sft_max_steps``) and no other snapshot is taken (:func:`_due`).
    Returns agent name → warmup.json contents."""
    lead = exp.agents[lead_index(exp, snapshots[0][0])]
    sft_agent = dataclasses.replace(lead, lr=lead.warmup_sft_lr, init_checkpoint=None)
    sft_exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, lr_schedule="constant", lr_warmup_steps=0))
    max_steps = max(exp.agents[i].warmup_sft_max_steps for i, _ in snapshots)
    rt = build_runtime(sft_exp, exp.agents.index(lead), max_steps, agent_cfg=sft_agent)
    try:
        return _warm_up(exp, rt, [(exp.agents[i], out) for i, out in snapshots], verifier)
    finally:  # a Ray agent's actors and placement group must be free for the RL run's own agent
        rt.close()


def _warm_up(exp: ExperimentConfig, rt: AgentRuntime, snapshots: list[tuple[AgentConfig, Path]],
             verifier: VerifierPool) -> dict[str, dict]:
    task = make_task(exp.data.task, exp.data.difficulty, exp.data.seed + 1, path=exp.data.path,  # apart from RL
                     **dataset_options(exp.data))
    pending = sorted(snapshots, key=lambda s: s[0].warmup_sft_target)
    mixture = pending[0][0].warmup_sft_families  # one run: every snapshot of it shares the lead's mixture
    check = WarmupCheck(task, mixture)
    batch_size, every = pending[0][0].warmup_sft_batch, pending[0][0].warmup_sft_eval_every
    start, step, out = time.time(), 0, {}
    while pending:
        records = (task.sample_mix(batch_size, step * batch_size, mixture) if mixture
                   else task.sample(batch_size, offset=step * batch_size))
        metrics = rt.trainer.train([sft_batch(rt, task, records)], sft_loss)[0]
        step += 1
        if step % every != 0 and all(step < a.warmup_sft_max_steps for a, _ in pending):
            continue
        rt.sync_weights()
        accuracy, per_family = check.accuracy(rt, verifier, exp.rollout.max_response_len)
        logger.info("warm-up %s: step %d: nll/token %.3f, greedy accuracy %.2f%s (targets %s)", rt.name, step,
                    metrics["nll_per_token"], accuracy,
                    "".join(f", {f} {a:.2f}" for f, a in per_family.items()), [a.warmup_sft_target for a, _ in pending])
        for agent, out_dir in _due(pending, accuracy, step):
            out[agent.name] = {"agent": agent.name, "steps": step, "greedy_accuracy": accuracy,
                               "seconds": time.time() - start}
            if per_family:
                out[agent.name]["family_accuracy"] = per_family
            if agent.warmup_sft_from is not None:
                out[agent.name]["snapshot_of"] = agent.warmup_sft_from
            _save_snapshot(rt, out_dir, out[agent.name])
            pending.remove((agent, out_dir))
    return out


class WarmupCheck:
    """The held-out problems a warm-up checks its greedy accuracy on, and how they are scored.

    Without a mixture: the first :data:`EVAL_ITEMS` of the task's held-out set (all of a small dataset's).
    With ``agents.*.warmup_sft_families``: :data:`EVAL_ITEMS` of each weighted family's own held-out stream;
    the accuracy is the weight-averaged family accuracy, the warm-up's own training distribution, and every
    family's accuracy (those of weight 0 too) is reported beside it (warmup.json's ``family_accuracy``).
    """

    def __init__(self, task: Task, mixture: dict[str, float]) -> None:
        self.mixture = mixture
        if mixture:
            self.records = {f: task.eval_set(EVAL_ITEMS, family=f) for f in task.families}
        else:
            n = min(EVAL_ITEMS, task.held_out) if isinstance(task, DatasetTask) else EVAL_ITEMS
            self.records = {"": task.eval_set(n)}

    def accuracy(self, rt: AgentRuntime, verifier: VerifierPool, max_new_tokens: int) -> tuple[float, dict[str, float]]:
        """(the accuracy the targets compare with, {family: accuracy} — empty without a mixture)."""
        if not self.mixture:
            return evaluate_agents([rt], self.records[""], verifier, max_new_tokens)[rt.name], {}
        per_family = {f: evaluate_agents([rt], records, verifier, max_new_tokens)[rt.name]
                      for f, records in self.records.items()}
        total = sum(self.mixture.values())
        return sum(w * per_family[f] for f, w in self.mixture.items()) / total, per_family


def _due(pending: list[tuple[AgentConfig, Path]], accuracy: float, step: int) -> list[tuple[AgentConfig, Path]]:
    """The snapshots to save at this check: every one at its ``warmup_sft_max_steps``, and the pending one
    of lowest target that ``accuracy`` reaches. One check that jumps past two targets (0.53 → 0.76 past
    0.60 and 0.75) saves only the lower one; the higher waits for a later check that still reaches it,
    so two snapshots of one run are never the same weights (``pending`` is sorted by target)."""
    forced = [s for s in pending if step >= s[0].warmup_sft_max_steps]
    reached = [s for s in pending if accuracy >= s[0].warmup_sft_target and s not in forced]
    return forced + reached[:1]


def _save_snapshot(rt: AgentRuntime, out_dir: Path, info: dict[str, Any]) -> None:
    """The runtime's current weights, tokenizer and ``info`` as an HF folder, written atomically."""

    def save(tmp: Path) -> None:
        rt.engine.model.save_pretrained(tmp)
        rt.tokenizer.save_pretrained(tmp)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))

    atomic_save_dir(out_dir, save, replace=True)  # a crashed warm-up never leaves a half-written cache entry


def pretrain_all(exp: ExperimentConfig, force: bool = False, only: str | None = None) -> dict[str, Path]:
    """Warm up every agent that needs it (``only``: that agent, with the agents its warm-up run also makes);
    returns name → HF checkpoint dir.

    Without ``force`` an agent's warm-up comes from the cache, else from the package's shipped
    warm-ups (same key), else it is trained into the cache.
    """
    configure_process(exp)
    exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, sft_warmup=True))
    out: dict[str, Path] = {}
    # the built-in verifier scores in-process; a user's checker gets a worker and the run's timeout
    with VerifierPool(num_workers=0, timeout_s=exp.train.verifier_timeout_s, mode=exp.train.verifier_mode,
                      score_fn=custom_score_fn(exp.data.checker, reward_range=exp.data.reward_range)) as verifier:
        runs: dict[int, list[int]] = {}  # lead agent → the agents whose snapshots its warm-up run makes
        for i, agent in enumerate(exp.agents):
            if needs_warmup(exp, agent):
                runs.setdefault(lead_index(exp, i), []).append(i)
        for members in runs.values():
            if only is not None and only not in [exp.agents[i].name for i in members]:
                continue  # `hacrl train --agent`: the other agents' jobs warm up their own
            found = {i: _existing_warmup(exp, i) for i in members}
            if force or None in found.values():  # one run writes every snapshot it makes
                found = {i: warmup_dir(exp, i) for i in members}
                for path in found.values():
                    path.parent.mkdir(parents=True, exist_ok=True)
                for name, info in warm_up_run(exp, list(found.items()), verifier).items():
                    logger.info("warm-up %s: done: %d steps, accuracy %.2f, %.0f s", name, info["steps"],
                                info["greedy_accuracy"], info["seconds"])
            out.update({exp.agents[i].name: path for i, path in found.items()})
    return out


def _existing_warmup(exp: ExperimentConfig, index: int) -> Path | None:
    """Agent ``index``'s warm-up from the cache, else the package's shipped one (same key), else None."""
    target, shipped = warmup_dir(exp, index), shipped_warmup(exp, index)
    if (target / INFO_FILE).exists():
        return target
    if shipped is not None:
        info = json.loads((shipped / INFO_FILE).read_text())
        logger.info("warm-up %s: shipped with the package (%d steps, accuracy %.2f) → %s", exp.agents[index].name,
                    info["steps"], info["greedy_accuracy"], shipped)
    return shipped


def apply_warmup(exp: ExperimentConfig, only: str | None = None) -> ExperimentConfig:
    """``exp`` with every agent that needs a warm-up (or agent ``only``, when it does) pointed at its
    (possibly new) cached checkpoint."""
    wanted = [a for a in exp.agents if needs_warmup(exp, a) and only in (None, a.name)]
    if not exp.train.sft_warmup or not wanted:
        return exp
    dirs = pretrain_all(exp, only=only)
    agents = [dataclasses.replace(a, init_checkpoint=str(dirs[a.name])) if a.name in dirs else a for a in exp.agents]
    return dataclasses.replace(exp, agents=agents)
