"""The HACRL loop for n agents. One step reads as the data flow of docs/architecture.md:

sample prompts → every agent's engine samples G responses → shared verifier → source log-prob
sums under π_old → each learner's views of all responses → capability tracker, advantages →
M mini-batch updates per learner (m = 0..M−1) → weight sync into the engines → metrics,
checkpoint, periodic evaluation.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hacrl_megatron.agents.ray_placement import TrainerNodeLost
from hacrl_megatron.algo import Algorithm, CapabilityTracker, build_algorithm, positive_rate
from hacrl_megatron.closing import close_all
from hacrl_megatron.config import ExperimentConfig
from hacrl_megatron.config.agent_jobs import agent_index, check_exchange_config
from hacrl_megatron.data import PromptRecord, Task
from hacrl_megatron.data.eval_sets import load_eval_benchmarks
from hacrl_megatron.data.formats import dataset_options
from hacrl_megatron.data.tasks import task_and_eval_set
from hacrl_megatron.exchange.retokenize import Exchange
from hacrl_megatron.reward.custom import custom_score_fn
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.rollout.servers import StartTogether
from hacrl_megatron.trainer import stages
from hacrl_megatron.trainer.best import update_best
from hacrl_megatron.trainer.checkpoint import load_checkpoint, resume_from
from hacrl_megatron.trainer.colocation import ColocationSchedule
from hacrl_megatron.trainer.concurrency import for_each, runs_in_process
from hacrl_megatron.trainer.evaluation import (
    accuracy_table,
    evaluate_agents,
    evaluate_agents_by_family,
    evaluate_benchmarks,
    format_scores,
)
from hacrl_megatron.trainer.guards import guarded_step
from hacrl_megatron.trainer.metrics import MetricsLogger
from hacrl_megatron.trainer.peers import PeerAgent, PeerExchange
from hacrl_megatron.trainer.pretrain import apply_warmup
from hacrl_megatron.trainer.rollout_source import RolloutRecord, RolloutSource, make_source, with_behaviour
from hacrl_megatron.trainer.run_checkpoints import RunCheckpoints, async_saves
from hacrl_megatron.trainer.run_folder import checkpoint_dir, claim_run_folder, resume_note
from hacrl_megatron.trainer.runtime import AgentRuntime, build_runtime, configure_process, export_hf
from hacrl_megatron.trainer.samples import sample_rows, write_samples, writes_samples

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """The live objects of one training run (built once by :func:`setup`)."""

    exp: ExperimentConfig
    algorithm: Algorithm
    runtimes: list[AgentRuntime]
    exchange: Exchange
    tracker: CapabilityTracker
    verifier: VerifierPool
    task: Task
    eval_records: list[PromptRecord]
    source: RolloutSource | None = None  # where each step's rollout comes from (trainer/rollout_source.py)
    step: int = 0
    history: dict[str, list[float]] = field(default_factory=dict)
    weights_version: int = 0  # the version the engines hold: the weights at the start of step weights_version
    rollout_tokens: dict[str, float] = field(default_factory=dict)  # per agent, whole run (metric and checkpoint)
    rollout_tokens_before: dict[str, float] = field(default_factory=dict)  # by the processes before a resume
    benchmarks: dict[str, list[PromptRecord]] = field(default_factory=dict)  # data.eval_benchmarks' problems
    samples: list[dict[str, Any]] = field(default_factory=list)  # the last step's samples rows (trainer/samples.py)
    best: dict[str, list[Any]] = field(default_factory=dict)  # checkpoint.export_best: agent → [score, step]
    # every agent of the run in config order: the runtimes, and a PeerAgent for each agent another job trains
    agents: list[Any] = field(default_factory=list)
    peers: PeerExchange | None = None  # `hacrl train --agent`: the exchange with the other jobs (trainer/peers.py)
    colocation: ColocationSchedule | None = None  # who holds the shared GPUs when (trainer/colocation.py)
    checkpoints: RunCheckpoints | None = None  # the run's saves, one in flight with checkpoint.async_save (_save)

    def __post_init__(self) -> None:
        self.agents = self.agents or list(self.runtimes)
        self.colocation = self.colocation or ColocationSchedule.for_run(self.exp, self.runtimes)

    @property
    def names(self) -> list[str]:
        """The agents trained in this process."""
        return [rt.name for rt in self.runtimes]

    @property
    def all_names(self) -> list[str]:
        """Every agent of the run, config order (equal to :attr:`names` unless agents train as separate jobs)."""
        return [a.name for a in self.agents]


def setup(exp: ExperimentConfig, agent: str | None = None) -> Run:
    """Build the run; ``agent``: only that agent of ``exp``, which meets its peers' jobs through the
    configured exchange (``hacrl train --agent``, trainer/peers.py)."""
    own = None if agent is None else agent_index(exp, agent)
    if own is not None:
        check_exchange_config(exp)
    # data first: a missing, empty or malformed data file fails before any warm-up or model build
    d = exp.data  # no held-out prompts when the run never evaluates (train.eval_every=0)
    task, eval_records = task_and_eval_set(d.task, d.difficulty, d.seed, d.path,
                                           d.eval_size if exp.train.eval_every else 0, **dataset_options(d))
    benchmarks = load_eval_benchmarks(d.eval_benchmarks, d.benchmark_paths, d.eval_limit, d.difficulty, d.seed)
    configure_process(exp)
    exp = apply_warmup(exp, only=agent)
    total_updates = exp.train.steps * exp.train.mini_batches
    algorithm = build_algorithm(exp.hacpo, len(exp.agents))
    runtimes = _build_runtimes(exp, total_updates, only=own)
    agents = [runtimes[0] if own == i else PeerAgent(i, a.name) for i, a in enumerate(exp.agents)] if agent else runtimes
    built = [rt.close for rt in reversed(runtimes)]  # what a later failure of setup closes
    try:
        if algorithm.passes.reference_on_self:  # the KL's frozen reference: the starting weights, before any resume
            for rt in runtimes:
                rt.trainer.keep_reference()
        r, h = exp.rollout, exp.hacpo
        exchange = Exchange({rt.name: rt.tokenizer for rt in runtimes}, eos_mode=r.eos_mode,
                            max_prompt_len=r.max_prompt_len, max_response_len=r.max_response_len + 1,
                            remote=[a.name for a in agents if isinstance(a, PeerAgent)])
        tracker = CapabilityTracker(len(agents), window=h.capability_window, ratio_min=h.omega_min,
                                    ratio_max=h.omega_max, log_ratio_window=h.adaptive_window_steps)
        verifier = VerifierPool(num_workers=exp.train.verifier_workers, timeout_s=exp.train.verifier_timeout_s,
                                mode=exp.train.verifier_mode,
                                score_fn=custom_score_fn(exp.data.checker, reward_range=exp.data.reward_range))
        built.insert(0, verifier.close)
        run = Run(exp, algorithm, runtimes, exchange, tracker, verifier, task, eval_records, benchmarks=benchmarks,
                  agents=agents)
        if agent is not None:
            run.peers = PeerExchange.open(exp, agents, runtimes[0])
            built.insert(0, run.peers.close)
        run.source = make_source(exp.train.rollout_mode, exp.train.max_staleness, lambda i: _prompts(run, i),
                                 lambda i, prompts: stages.rollout(run.runtimes, prompts, run.exp, run.algorithm, i),
                                 lambda: {name: run.weights_version for name in run.names}, lambda: run.step,
                                 concurrent=not any(runs_in_process(rt.engine) for rt in runtimes),
                                 end=exp.train.steps)
    except BaseException as err:
        close_all(built, primary=err)
        raise
    return run


def _build_runtimes(exp: ExperimentConfig, total_updates: int, only: int | None = None) -> list[AgentRuntime]:
    """Every agent's runtime (or agent ``only``'s), in config order (trainers placed in the plan's order; the
    engine servers of all agents start together, rollout/servers.StartTogether). When one fails,
    those already built are closed (their engines stopped, their placement groups released) and the
    error that stopped setup is raised."""
    runtimes: list[AgentRuntime] = []
    try:
        with StartTogether():  # every agent's engine servers come up at once, while the next agent is built
            if only is None:
                for i in range(len(exp.agents)):
                    runtimes.append(build_runtime(exp, i, total_updates))
            else:  # a job of one agent: its nodes, GPUs and cores are laid out for it alone (its own
                # allocation); its seeds stay those of its index in the shared config
                job = dataclasses.replace(exp, agents=[exp.agents[only]])
                runtimes.append(build_runtime(job, only, total_updates, agent_cfg=exp.agents[only]))
    except BaseException as err:
        close_all([rt.close for rt in reversed(runtimes)], primary=err)
        raise
    return runtimes


def _prompts(run: Run, index: int) -> list[PromptRecord]:
    """Batch ``index``'s prompts: the data position is the batch itself (offset index × prompts_per_step)."""
    p = run.exp.train.prompts_per_step
    return run.task.sample(p, offset=index * p)


def _overlap_window(exp: ExperimentConfig) -> int:
    """Versions a batch may lag behind its step: 0 (sync), 1 (one_step_off), K (async)."""
    return {"sync": 0, "one_step_off": 1}.get(exp.train.rollout_mode, exp.train.max_staleness)


def _next_rollout(run: Run, metrics: dict[str, float]) -> tuple[RolloutRecord, dict[str, torch.Tensor]]:
    """The step's batch from the source, and Σ log π_behav of the agents it lags for (docs/algorithm.md §7b).

    Overlapping modes first snapshot the weights this step starts from (the behaviour policy of the
    batches generated during it) and free those no queued batch can need any more."""
    window = _overlap_window(run.exp)
    if window:
        for rt in run.runtimes:
            rt.trainer.keep_version(run.step)
            rt.trainer.drop_versions(run.step - window)
    record = run.source.next(run.step)
    if window:  # the synchronous loop's metrics stay as they were
        for name, version in record.versions.items():
            metrics[f"{name}/staleness"] = float(run.step - version)
        metrics["rollout/dropped_batches"] = float(run.source.stats.dropped)
        metrics["rollout/wait_s"] = run.source.stats.wait_s
    behaviour = record.behaviour or _behaviour(run, record)
    return record, {name: torch.tensor(sums, dtype=torch.float64) for name, sums in behaviour.items()}


def _behaviour(run: Run, record: RolloutRecord) -> dict[str, list[float]]:
    """Σ log π_behav of every lagging agent's own responses in ``record``, from the weight snapshots."""
    r = run.exp.rollout
    return stages.behaviour_logprobs(run.runtimes, record.prompts, record.completions, run.exchange, record.versions,
                                     run.step, r.temperature, r.max_response_len + 1)


def _update_learners(run: Run, data: stages.StepData, omega: torch.Tensor, step: int, algorithm: Algorithm,
                     prompt_families: torch.Tensor | None = None) -> dict[str, float]:
    """M mini-batch updates per learner; agents with their own workers (Ray) update concurrently.
    ``prompt_families``: :func:`stages.prompt_family_index` of the step's prompts (the per-family metrics, §10b)."""
    exp, metrics, launched = run.exp, {}, []
    loss_fn = algorithm.loss_fn(run.all_names, stages.task_families(run.task))
    centers = algorithm.cross_centers(run.tracker)  # adaptive cross window (docs/algorithm.md §5b)
    for rt in run.runtimes:
        batch = stages.learner_batch(rt, run.agents, data, run.exchange, omega, algorithm, centers, prompt_families)
        minis = stages.split_mini_batches(batch, exp.train.mini_batches, stages.step_seed(exp, step, 1000 + rt.index),
                                          exp.train.minibatch_order)
        launched.append((rt, len(batch), rt.trainer.train_async(minis, loss_fn, exp.rollout.temperature)))
    for rt, num_sequences, pending in launched:
        per_update = pending.result()
        for key in sorted({k for u in per_update for k in u}):  # per-pair keys exist only where the pair had samples
            values = [u[key] for u in per_update if key in u]
            metrics[f"{rt.name}/hacpo/{key}"] = sum(values) / len(values)
        if f"{rt.name}/hacpo/kl" in metrics:  # the KL to the starting policy, at the agent's top level too
            metrics[f"{rt.name}/kl"] = metrics[f"{rt.name}/hacpo/kl"]
        first = per_update[0]
        if first.get("num_self", 0) > 0 and "self_ratio_max" in first:
            # m = 0 is on-policy: old and new log-probs of self samples agree up to float noise
            metrics[f"{rt.name}/hacpo/onpolicy_ratio_dev"] = max(first["self_ratio_max"] - 1, 1 - first["self_ratio_min"])
        if run.tracker.steps_seen:  # none yet only in a job that trained alone from its first step
            metrics[f"{rt.name}/capability"] = float(run.tracker.capability()[rt.index])
        for other in run.agents:
            metrics[f"{rt.name}/omega/{other.name}"] = float(omega[rt.index, other.index])
        metrics[f"{rt.name}/sequences"] = float(num_sequences)
    return metrics


def _sync_engines(run: Run, probe: PromptRecord) -> dict[str, float]:
    """Push every agent's weights into its engines and check them on a probe sequence, in the colocation
    schedule's order (trainer/colocation.py); agents whose trainer and engines both run elsewhere sync at
    the same time (trainer/concurrency.py)."""
    response_text = run.task.sft_target(probe)

    def probe_ids(rt: AgentRuntime) -> tuple[list[int], list[int]]:
        return rt.prompt_ids(probe.question), rt.tokenizer(response_text, add_special_tokens=False)["input_ids"]

    diffs = run.colocation.sync(probe_ids)

    def sync(rt: AgentRuntime) -> dict[str, float]:
        metrics = {f"{rt.name}/sync_logp_diff": diffs[rt.name]}
        gen = rt.engine.stats()
        metrics[f"{rt.name}/rollout_tokens_per_s"] = float(gen["tokens_per_s"])
        # the engine counts since it started: add what the run's earlier processes generated (resume)
        run.rollout_tokens[rt.name] = run.rollout_tokens_before.get(rt.name, 0.0) + float(gen["tokens"])
        metrics[f"{rt.name}/rollout_tokens_total"] = run.rollout_tokens[rt.name]
        for key, value in gen.items():  # per-engine counters of an SGLang pool ("engine0/tokens_per_s", ...)
            if "/" in key:
                metrics[f"{rt.name}/rollout/{key}"] = float(value)
        for key, value in rt.trainer.stats().items():
            metrics[f"{rt.name}/trainer/{key}"] = float(value)
        return metrics

    out: dict[str, float] = {}
    for metrics in for_each(run.runtimes, sync, lambda rt: runs_in_process(rt.trainer, rt.engine)):  # stats calls
        out.update(metrics)
    return out


def train_step(run: Run) -> dict[str, float]:
    """One HACRL step for every agent; returns namespaced metrics."""
    exp, step, timings = run.exp, run.step, {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[f"time/{name}_s"] = now - clock
        clock = now

    metrics: dict[str, float] = {}
    run.colocation.for_generation()  # colocated: the trainers sleep while the engines generate
    record, behaviour = _next_rollout(run, metrics)  # sync: sampled now; overlapping: sampled while training
    prompts = record.prompts
    run.colocation.for_training()  # colocated engines hand their GPU memory to the trainers until the sync
    lap("rollout")
    data = stages.verify(run.verifier, prompts, record.completions, step, exp.rollout.max_response_len + 1)
    lap("verify")
    stages.old_logprobs(run.runtimes, data, run.exchange, run.algorithm, exp.rollout.temperature,
                        cross=run.peers is None)
    data.passes.behaviour_on_self.update(behaviour)
    lap("old_logprob")
    algorithm, missing = run.algorithm, []
    if run.peers is not None:  # a job of `hacrl train --agent`: publish, then the peers' responses join the step
        data, algorithm, missing = _exchange(run, data, record.versions, metrics)
        lap("exchange")
    if not missing:  # the tracker needs every agent's positive rate (a step trained alone leaves it as it was)
        run.tracker.update([positive_rate(data.rewards[:, i]) for i in range(len(run.agents))])
    # ω (eq. 9); a job that trained alone since its first step has no rates yet: ω = 1 (GSPO ignores it)
    n = len(run.agents)
    omega = run.tracker.omega() if run.tracker.steps_seen else torch.ones(n, n, dtype=torch.float64)
    run.samples = []
    if writes_samples(exp, step + 1):  # before the updates: the ratios and clips the first update sees
        run.samples = sample_rows(run.agents, data, run.exchange, algorithm, omega, algorithm.cross_centers(run.tracker),
                                  exp, step + 1, learners=[rt.index for rt in run.runtimes])
        write_samples(exp.output_dir, step + 1, run.samples)
        lap("samples")
    prompt_families = stages.prompt_family_index(run.task, data.prompts)  # per-family metrics (§10b)
    metrics.update(stages.reward_metrics(data, run.runtimes, prompt_families, stages.task_families(run.task)))
    metrics.update(_update_learners(run, data, omega, step, algorithm, prompt_families))
    algorithm.record_cross_statistics(run.tracker, metrics, run.all_names)  # used from the next step on
    lap("train")
    waited = run.source.stats.wait_s
    run.source.finish_in_flight()  # one_step_off: the next batch samples with the weights this step started from
    with run.source.engines_idle():  # between two generate calls of an overlapping producer
        clock += run.source.stats.wait_s - waited  # that wait is rollout/wait_s, not time/sync_s
        metrics.update(_sync_engines(run, probe=prompts[0]))
        run.weights_version = step + 1
    lap("sync")
    if run.peers is not None:
        run.peers.prune(step)
    if "rollout/wait_s" in metrics:  # overlapping modes: the batch, the batch in flight, the call in flight
        metrics["rollout/wait_s"] = run.source.stats.wait_s
    metrics.update(run.exchange.pop_metrics(""))  # per-step statistics
    metrics.update(timings)
    metrics["verifier/timeouts"] = float(run.verifier.stats["timeouts"])
    metrics["verifier/errors"] = float(run.verifier.stats["errors"])
    run.step += 1
    return metrics


def _exchange(run: Run, data: stages.StepData, versions: dict[str, int],
              metrics: dict[str, float]) -> tuple[stages.StepData, Algorithm, list[str]]:
    """Publish this job's responses of the step, wait for the peers' (exchange.on_missing), and return the
    step's data with every agent's responses, the step's algorithm (GSPO when a peer is left out) and
    the peers left out; the learners' π_old over the peers' responses is computed here."""
    own, step = run.runtimes[0], run.step
    behaviour = data.passes.behaviour_on_self
    run.peers.publish(step, data, behaviour, versions[own.name])
    started = time.perf_counter()
    records, missing = run.peers.gather(step)
    metrics[f"{own.name}/exchange/wait_s"] = time.perf_counter() - started
    metrics[f"{own.name}/exchange/peers_missing"] = float(len(missing))
    data = run.peers.merge(step, data, records, behaviour)
    algorithm = run.peers.step_algorithm(run.algorithm, missing)
    if algorithm.passes.learner_old_on_others:
        stages.learner_old_on_others(run.runtimes, run.agents, data, run.exchange, run.exp.rollout.temperature)
    return data, algorithm, missing


def _save(run: Run) -> None:
    run.colocation.for_training()  # the trainers' whole state, on their GPUs
    # the data position is the step itself (prompts are sampled at offset step × prompts_per_step); an
    # overlapping run also saves its finished, untrained batches with their behaviour log-probs
    state = {"tracker": run.tracker.state_dict(), "history": run.history, "rollout": _rollout_state(run),
             "best": run.best, "rollout_tokens": dict(run.rollout_tokens)}
    if run.checkpoints is None:
        run.checkpoints = RunCheckpoints(checkpoint_dir(run.exp), run.exp.checkpoint.keep, async_saves(run.exp))
    run.checkpoints.save(run.step, run.runtimes, state)  # async: written while the next steps train


def _resume(run: Run) -> bool:
    root = checkpoint_dir(run.exp)

    def restore(path: Path) -> dict[str, Any]:  # any failure here makes resume_from try the previous one
        state = load_checkpoint(path, run.runtimes)
        run.tracker.load_state_dict(state["tracker"])
        run.history, run.step = state["history"], int(state["step"])
        run.best = state.get("best", {})  # checkpoints written before checkpoint.export_best existed have none
        run.rollout_tokens_before = {k: float(v) for k, v in state.get("rollout_tokens", {}).items()}
        return state

    found = resume_from(root, restore)  # the newest that verifies and loads; damaged newer ones are skipped (logged)
    if found is None:
        logger.warning("checkpoint.resume=true but no checkpoint in %s: starting fresh", root)
        return False
    path, state = found
    for rt in run.runtimes:
        rt.sync_weights()
    run.weights_version = run.step
    saved = state.get("rollout") or {"records": [], "next_index": None}
    run.source.restore([RolloutRecord.from_state(r) for r in saved["records"]],
                       run.step if saved["next_index"] is None else int(saved["next_index"]))
    logger.info("resumed from step %d (%s)", run.step, path)
    return True


def _rollout_state(run: Run) -> dict[str, Any]:
    """The source's finished batches (behaviour log-probs filled in while the snapshots exist) and where
    its producer goes on: plain values for the checkpoint."""
    pending, next_index = run.source.snapshot()  # one instant: a batch finishing meanwhile is regenerated
    records = [r if r.behaviour is not None or r.staleness(run.step) == 0 else with_behaviour(r, _behaviour(run, r))
               for r in pending]
    run.source.replace_pending(records)
    return {"records": [r.to_state() for r in records], "next_index": next_index}


def _evaluates(exp: ExperimentConfig, step: int) -> bool:
    """Whether the run evaluates after ``step`` steps: every train.eval_every steps and after the last one."""
    e = exp.train.eval_every
    return bool(e and (exp.data.eval_size or exp.data.eval_benchmarks) and (step % e == 0 or step == exp.train.steps))


def _evaluate(run: Run, out: MetricsLogger) -> dict[str, float]:
    """Greedy accuracy on the held-out set and avg@k / pass@k on the benchmarks, each printed once."""
    metrics: dict[str, float] = {}
    run.colocation.for_generation()
    with run.source.engines_idle():
        if run.eval_records:
            families: dict[str, float] = {}
            if stages.task_families(run.task):  # per-family accuracy: <agent>/eval/<family>/accuracy
                acc, families = evaluate_agents_by_family(run.runtimes, run.eval_records, run.task.family_of,
                                                          run.verifier, run.exp.rollout.max_response_len)
            else:
                acc = evaluate_agents(run.runtimes, run.eval_records, run.verifier, run.exp.rollout.max_response_len)
            for name, value in {**acc, **families}.items():
                run.history.setdefault(name, []).append(value)
            out.write(f"step {run.step}: eval greedy accuracy " + ", ".join(
                f"{k}={v:.3f}" for k, v in acc.items()) + "".join(f", {k}={v:.3f}" for k, v in families.items()))
            metrics.update({f"{name}/eval_accuracy": value for name, value in acc.items()})
            metrics.update(families)
        if run.benchmarks:
            scores = evaluate_benchmarks(run.runtimes, run.benchmarks, run.verifier, run.exp, run.step)
            for key, value in scores.items():
                if "/avg@" in key:
                    run.history.setdefault(key, []).append(value)
            out.write(f"step {run.step}: eval {format_scores(scores)}")
            metrics.update(scores)
    if run.exp.checkpoint.export_best:  # trainer/best.py

        def export(rt: AgentRuntime, folder: Path) -> Path:
            run.colocation.for_training()  # only when an agent improved: the export reads its weights
            return export_hf(rt, folder)

        for line in update_best(run.best, metrics, run.step, run.runtimes, run.exp.output_dir, export):
            out.write(line)
    return metrics


def train(exp: ExperimentConfig, agent: str | None = None) -> Run:
    """Run (or resume) a whole experiment; returns the finished :class:`Run`. ``agent``: train only that
    agent, meeting the other agents' jobs through ``exchange.*`` (``hacrl train --agent``, docs/exchange.md).

    Before any work the run folder is locked for the run's lifetime and checked: one run per folder,
    continued only with ``checkpoint.resume=true`` and an agreeing config (trainer/run_folder.py).
    """
    with claim_run_folder(exp) as claimed:
        return _train(exp, claimed.run_id, agent)


def _train(exp: ExperimentConfig, run_id: str = "", agent: str | None = None) -> Run:
    run = setup(exp) if agent is None else setup(exp, agent)  # the one-process call as it always was
    exp = run.exp
    if run.peers is not None:
        try:
            if not exp.checkpoint.resume:
                run.peers.check_fresh()  # records of this agent under the run id belong to an earlier run
            run.peers.join_run()  # the run's nonce: records of an earlier run of this run id are refused
            run.peers.take_agent()  # another job of this agent (or this one before a restart) stops at its publish
        except BaseException as err:
            close_all([run.source.close, run.verifier.close, run.peers.close, *(rt.close for rt in run.runtimes)],
                      primary=err)
            raise
    resumed = exp.checkpoint.resume and _resume(run)
    out = MetricsLogger(exp, Path(exp.output_dir), exp.train.steps, start_step=run.step, run_id=run_id)
    failure = None
    try:
        if not resumed and _evaluates(exp, 0):
            out.log(0, _evaluate(run, out), advance=False)
        while run.step < exp.train.steps:
            metrics = guarded_step(run, train_step)  # a non-finite loss/grad/weights stops before the checkpoint
            if run.checkpoints is not None and (waited := run.checkpoints.take_wait_s()) is not None:
                metrics["time/checkpoint_wait_s"] = waited  # the save after the previous step
            if _evaluates(exp, run.step):
                metrics.update(_evaluate(run, out))
            summary = {f"{n} reward": metrics[f"{n}/reward_mean"] for n in run.names}  # the progress bar's labels
            out.log(run.step, metrics, summary)
            out.log_samples(run.step, run.samples)
            every = exp.checkpoint.every
            if every and (run.step % every == 0 or run.step == exp.train.steps):
                _save(run)
        if run.checkpoints is not None:
            run.checkpoints.finish()  # the last checkpoint is complete before the final export
        if run.history:
            out.write(accuracy_table(run.history, exp))
        run.colocation.for_training()
        for rt in run.runtimes:  # each agent is deployed alone: a plain HF folder per agent
            out.write(f"{rt.name}: final weights → {export_hf(rt, Path(exp.output_dir) / 'final' / rt.name)}")
    except TrainerNodeLost as err:  # a trainer rank's node left the cluster: one line, and where to resume
        failure = TrainerNodeLost(f"{err}; {resume_note(exp)}")
        raise failure from err
    except BaseException as err:
        failure = err
        raise
    finally:  # the error that stopped the run stays primary (a full disk also fails closing the metrics)
        if failure is not None and run.checkpoints is not None:
            run.checkpoints.settle(failure)  # a save in flight: finished after an error, abandoned when interrupted
        closers = [run.source.close, out.close, run.verifier.close, *(rt.close for rt in run.runtimes)]
        close_all(closers + ([run.peers.close] if run.peers is not None else []), primary=failure)
    return run
