"""Compare HACPO with its baselines (docs/algorithm.md §8, §10) on one preset over several seeds.

    python tools/compare.py [--preset cpu_demo] [--methods hacpo gspo_x2 naive] [--seeds 0 1 2 3 4]
                            [--baseline hacpo [gspo_x2 ...]] [--last 3] [--report-only]
                            [--set train.steps=40 agents.0.backend=hf ...] [--out runs/compare] [--jobs 2]

Every (method, seed) run trains with the same ``train.steps`` and ``train.mini_batches``, so each
agent makes the same number of optimizer updates under every method; only the rollouts differ
(GSPO×2 samples 2G responses per prompt, docs/algorithm.md §8). Runs of one seed share one SFT warm-up
checkpoint: the warm-up cache key (trainer/pretrain.py ``warmup_dir``) covers ``train.seed`` and the
agent configs but not ``hacpo.algorithm`` — checked before anything runs. Warm-ups run first, one
task per seed (``pretrain_all``), then the RL runs, in a pool of ``--jobs`` processes (a fresh process per
run, one torch thread each; a seed's runs start once its warm-up is written). Each run lives in ``OUT/<method>-seed<seed>/``; a run whose ``metrics.jsonl`` reaches
the final step and which has ``done.json`` is skipped on a re-run, an interrupted one resumes from
its last checkpoint. Seeds run into separate ``--out`` folders are reported together by linking their run
folders under one ``--out`` and ``--report-only`` (a run's recorded ``output_dir`` is not compared).

Outputs in ``OUT``: ``compare.md`` (the summary table, one row per seed, and the differences to
each ``--baseline`` paired by seed: mean ± std and how many seeds favour each side, on the final
evaluation and with ``--last K`` on the mean of the last K; then the per-pair cross statistics; see
tools/compare_report.py), ``compare.json`` (every number), ``compare.png`` (final accuracy bars with
±std error bars, and the seed-mean greedy learning curves per agent), ``compare_paired.png`` (each
method's paired differences to each baseline, one dot per seed). Methods are the algorithms of
docs/algorithm.md §8 and the HACPO variants of §5a-5d (``hacpo+pessimistic``, ``hacpo+adaptive``,
``hacpo+both``, ``hacpo+gspo_clip``, ``hacpo+decoupled``, ``hacpo+parity``, and the rollout modes ``hacpo+one_step_off``, ``hacpo+async2``),
the paper's ablations of §8 (``hacpo-adv``, ``hacpo-omega``, ``hacpo-stepwise``, ``hacpo-clip``), and the other
ways to share rollouts of §8a (``mutual_prp``, ``mutual_xgrpo``, ``mutual_sgt``, ``ftis``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python tools/compare.py` from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from hacrl_megatron.config import ALGORITHMS, ConfigError, ExperimentConfig, load_config  # noqa: E402
from tools.compare_cross import PairStats, cross_sections, pair_stats, pair_table, peer_table  # noqa: E402,F401
from tools.compare_report import (  # noqa: E402,F401  (re-exported: tests and notebooks use tools.compare.*)
    METHOD_LABELS,
    AgentRun,
    AgentSummary,
    CompareError,
    MethodSummary,
    RunResult,
    _mean_or_none,
    family_results,
    last_k_mean,
    load_results,
    markdown_table,
    mean_std,
    merge_included,
    paired_differences,
    paired_table,
    per_seed_table,
    plot_paired,
    plot_summary,
    report_tables,
    summarise,
)
from tools.compare_runs import check_same_run, claim_dir, finished_runs, is_done, last_step  # noqa: E402,F401

DEFAULT_METHODS = ("hacpo", "gspo_x2", "naive")
# HACPO variants of docs/algorithm.md §5a-5d: method name → the overrides on top of hacpo.algorithm=hacpo
VARIANTS = {
    "hacpo+pessimistic": ("hacpo.cross_clip_mode=pessimistic",),
    "hacpo+adaptive": ("hacpo.cross_window=adaptive",),
    "hacpo+both": ("hacpo.cross_clip_mode=pessimistic", "hacpo.cross_window=adaptive"),
    "hacpo+gspo_clip": ("hacpo.cross_clip_mode=gspo",),
    "hacpo+decoupled": ("hacpo.cross_clip_mode=decoupled",),
    # the reference code's training settings (docs/algorithm.md §6-7): KL 1e-3 on self responses, every EOS
    # stripped, self samples first in the mini-batches
    "hacpo+parity": ("hacpo.kl_coef=1e-3", "hacpo.kl_estimator=low_var_kl", "rollout.eos_mode=strip_all",
                     "train.minibatch_order=self_first"),
    # rollout overlapping training (docs/algorithm.md §7b): the same HACPO objective, fed by a producer
    # one weight version behind (one_step_off) or up to K = 2 versions behind (async)
    "hacpo+one_step_off": ("train.rollout_mode=one_step_off",),
    "hacpo+async2": ("train.rollout_mode=async", "train.max_staleness=2"),
    # the paper's ablations (docs/algorithm.md §8): one mechanism of HACPO switched off
    "hacpo-adv": ("hacpo.capability_aware_advantage=false",),
    "hacpo-omega": ("hacpo.discrepancy_coefficient=false",),
    "hacpo-stepwise": ("hacpo.stepwise=false",),
    "hacpo-clip": ("hacpo.cross_clip=false",),
}
# Settings every comparison run gets before the user's --set (which may override them): quiet logs
# in a file, and resume from the run's own checkpoint after an interruption.
RUN_DEFAULTS = ("log.progress=false", "log.tensorboard=false", "checkpoint.resume=true")


@dataclass(frozen=True)
class RunSpec:
    """One (method, seed) training run."""

    method: str
    seed: int
    overrides: tuple[str, ...]  # full override list handed to load_config
    out_dir: Path
    exp: ExperimentConfig = field(repr=False)

    @property
    def name(self) -> str:
        return f"{self.method}-seed{self.seed}"


# --------------------------------------------------------------------------------------------
# planning


def plan_runs(preset: str, methods: list[str], seeds: list[int], sets: list[str], out: Path) -> list[RunSpec]:
    """Validated configs of every (method, seed) run; raises CompareError/ConfigError on bad input."""
    unknown = [m for m in methods if m not in ALGORITHMS and m not in VARIANTS]
    if unknown:
        raise CompareError(f"--methods: unknown {unknown}; allowed: {list(ALGORITHMS) + list(VARIANTS)}")
    if len(set(methods)) != len(methods) or len(set(seeds)) != len(seeds):
        raise CompareError(f"--methods {methods} / --seeds {seeds}: duplicates are not allowed")
    for key in ("hacpo.algorithm", "train.seed", "output_dir"):
        if any(s.split("=", 1)[0].strip() == key for s in sets):
            raise CompareError(f"--set {key}=...: compare.py sets {key} itself for every run")
    specs = []
    for seed in seeds:
        for method in methods:
            run_dir = out / f"{method}-seed{seed}"
            algorithm = "hacpo" if method in VARIANTS else method
            overrides = (*RUN_DEFAULTS, *sets, *VARIANTS.get(method, ()), f"hacpo.algorithm={algorithm}",
                         f"train.seed={seed}", f"output_dir={run_dir}")
            exp = load_config(preset, list(overrides))
            if not (exp.train.eval_every > 0 and exp.data.eval_size > 0):
                raise CompareError("compare needs greedy evaluation: train.eval_every and data.eval_size must be > 0 "
                                   f"(got {exp.train.eval_every}, {exp.data.eval_size})")
            specs.append(RunSpec(method, seed, overrides, run_dir, exp))
    check_equal_budget(specs)
    return specs


def check_equal_budget(specs: list[RunSpec]) -> None:
    """Every run must make the same optimizer updates per agent: same steps and mini-batches."""
    shape = {(s.exp.train.steps, s.exp.train.mini_batches, s.exp.train.prompts_per_step) for s in specs}
    if len(shape) != 1:
        raise CompareError(f"runs differ in (train.steps, train.mini_batches, train.prompts_per_step): {sorted(shape)}")


def warmup_dirs(spec: RunSpec) -> list[Path | None]:
    """The warm-up cache folder of each agent of ``spec`` (None where the agent needs no warm-up)."""
    from hacrl_megatron.trainer.pretrain import needs_warmup, warmup_dir

    exp = spec.exp
    return [warmup_dir(exp, i) if needs_warmup(exp, a) else None for i, a in enumerate(exp.agents)]


def check_shared_warmup(specs: list[RunSpec]) -> dict[int, list[Path | None]]:
    """Seed → per-agent warm-up folder, after checking that every method of a seed maps to the same one."""
    by_seed: dict[int, list[Path | None]] = {}
    for spec in specs:
        dirs = warmup_dirs(spec)
        first = by_seed.setdefault(spec.seed, dirs)
        if dirs != first:
            raise CompareError(f"seed {spec.seed}: method {spec.method!r} would warm up into {dirs}, other methods "
                               f"into {first}; methods of one seed must start from the same checkpoint")
    return by_seed


def rollouts_per_agent(exp: ExperimentConfig) -> int:
    """Responses each agent generates over the run: prompts_per_step × G (×2 for GSPO×2) × steps."""
    from hacrl_megatron.algo import build_algorithm

    g = build_algorithm(exp.hacpo, len(exp.agents)).samples_per_prompt(exp.rollout.samples_per_prompt)
    return exp.train.prompts_per_step * g * exp.train.steps


# --------------------------------------------------------------------------------------------
# tasks (each in a fresh pool process, or all in this process with --jobs 1)


@dataclass(frozen=True)
class WarmupTask:
    """Warm up every agent of one seed that needs it (the trainer's own cached ``pretrain_all``)."""

    preset: str
    overrides: tuple[str, ...]
    seed: int
    log: Path

    @property
    def label(self) -> str:
        return f"warm-up seed {self.seed}"

    def run(self) -> None:
        from hacrl_megatron.trainer.pretrain import pretrain_all

        for name, path in pretrain_all(load_config(self.preset, list(self.overrides))).items():
            print(f"[warm-up {name}] checkpoint {path}", flush=True)


@dataclass(frozen=True)
class TrainTask:
    """One (method, seed) run; writes ``done.json`` (history, rollouts, wall time) when it finishes."""

    preset: str
    overrides: tuple[str, ...]
    seed: int
    method: str
    out_dir: Path
    log: Path

    @property
    def label(self) -> str:
        return f"{self.method} seed {self.seed}"

    def run(self) -> None:
        from hacrl_megatron.trainer.loop import train

        exp = load_config(self.preset, list(self.overrides))
        start = time.time()
        run = train(exp)
        done = {"method": self.method, "seed": self.seed, "steps": run.step, "wall_s": time.time() - start,
                "history": run.history, "rollouts_per_agent": rollouts_per_agent(exp)}
        (self.out_dir / "done.json").write_text(json.dumps(done, indent=1))


Task = WarmupTask | TrainTask


def run_task(task: Task) -> None:
    """Execute one task with one torch thread (the comparison shares few cores between runs)."""
    import torch

    from hacrl_megatron.console import log_to_console

    torch.set_num_threads(1)
    log_to_console()  # the trainer's progress messages (warm-up accuracy, resume) go to the task's log
    task.run()


def plan_tasks(preset: str, specs: list[RunSpec], warm: dict[int, list[Path | None]]) -> list[Task]:
    """Warm-up tasks first (one per seed that still lacks a checkpoint), then training tasks."""
    tasks: list[Task] = []
    first_of_seed: dict[int, RunSpec] = {}
    for spec in specs:
        first_of_seed.setdefault(spec.seed, spec)
    todo = [spec for spec in specs if not is_done(spec)]
    for seed, dirs in warm.items():
        if any(s.seed == seed for s in todo) and any(d is not None and not (d / "warmup.json").exists() for d in dirs):
            spec = first_of_seed[seed]
            tasks.append(WarmupTask(preset, spec.overrides, seed, spec.out_dir.parent / f"warmup-seed{seed}.log"))
    for spec in specs:
        if is_done(spec):
            print(f"[compare] {spec.name}: finished earlier, skipped", flush=True)
            continue
        claim_dir(spec)
        tasks.append(TrainTask(preset, spec.overrides, spec.seed, spec.method, spec.out_dir, spec.out_dir / "train.log"))
    return tasks


def execute(tasks: list[Task], jobs: int) -> None:
    """Run tasks: ``jobs == 1`` in this process (no start-up cost per run), else in a pool of ``jobs``
    processes, a fresh one per task; a seed's training is submitted once its warm-up has finished.

    After a failure nothing new starts; running tasks finish. Raises RuntimeError naming the log
    file of the first task that failed.
    """
    for task in tasks:
        task.log.parent.mkdir(parents=True, exist_ok=True)
    if jobs == 1:
        for task in tasks:
            print(f"[compare] {task.label} (log {task.log})", flush=True)
            _run_logged(task)
        return
    warm_seeds = {t.seed for t in tasks if isinstance(t, WarmupTask)}
    waiting = [t for t in tasks if isinstance(t, TrainTask) and t.seed in warm_seeds]
    failed: list[Task] = []
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               max_tasks_per_child=1, initializer=_single_threaded)
    with pool:
        running = {_submit(pool, t): (t, time.time()) for t in tasks if t not in waiting}
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                task, t0 = running.pop(future)
                if future.cancelled():
                    continue
                err = future.exception()
                status = f"done in {future.result():.0f} s" if err is None else f"FAILED ({type(err).__name__}: {err})"
                print(f"[compare] {task.label}: {status} ({time.time() - t0:.0f} s after it was queued)", flush=True)
                if err is not None:
                    failed.append(task)
                    for other in running:  # nothing new starts after a failure
                        other.cancel()
                elif isinstance(task, WarmupTask) and not failed:
                    ready = [t for t in waiting if t.seed == task.seed]
                    waiting = [t for t in waiting if t.seed != task.seed]
                    running.update({_submit(pool, t): (t, time.time()) for t in ready})
    if failed:
        raise RuntimeError(f"{failed[0].label} failed; see {failed[0].log}:\n{_tail(failed[0].log)}")


def _submit(pool: ProcessPoolExecutor, task: Task) -> Future:
    print(f"[compare] queued {task.label} (log {task.log})", flush=True)
    return pool.submit(_run_in_child, task)


def _single_threaded() -> None:
    """Pool initializer: one OpenMP/MKL thread, set before the task imports torch; the worker ends when
    tools/compare.py does (see :func:`end_with_parent`)."""
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    end_with_parent(os.getppid())


def end_with_parent(parent: int, poll_s: float = 1.0, grace_s: float = 30.0) -> threading.Thread:
    """Watch from a daemon thread: once this process's parent is no longer ``parent`` (tools/compare.py was
    killed, even with SIGKILL, and the pool worker re-parented), SIGTERM this process (a run stops as on a
    scheduler's stop, its verifier workers with it) and SIGKILL it ``grace_s`` later. Without it a killed
    comparison leaves its runs training on, unseen."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="end-with-parent", daemon=True)
    thread.start()
    return thread


def _run_in_child(task: Task) -> float:
    """Run ``task`` in a pool process; its whole output (Python and native) goes to the task's log. The
    ``started`` line goes to the parent's output (inherited) before that. Returns the run's wall seconds."""
    print(f"[compare] started {task.label}", flush=True)
    t0 = time.time()
    with open(task.log, "w") as fh:
        os.dup2(fh.fileno(), 1)
        os.dup2(fh.fileno(), 2)
        try:
            run_task(task)
        except BaseException:
            traceback.print_exc()
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    return time.time() - t0


def _run_logged(task: Task) -> None:
    log = logging.getLogger("hacrl_megatron")
    handlers, level = list(log.handlers), log.level  # run_task adds a console handler: undone afterwards
    with open(task.log, "w") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
        try:
            run_task(task)
        except Exception as err:
            print(f"{type(err).__name__}: {err}", file=fh)
            raise
        finally:
            log.handlers[:], log.level = handlers, level


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


# --------------------------------------------------------------------------------------------
# results


def run_result(spec: RunSpec) -> RunResult:
    """Per-agent greedy accuracy curve, start/final values, rollouts and timing of one finished run."""
    from hacrl_megatron.trainer.metrics import read_metrics

    path = spec.out_dir / "metrics.jsonl"
    if not path.exists():
        raise CompareError(f"{path}: missing; run {spec.name} has not written metrics")
    rows = read_metrics(path)
    done_path = spec.out_dir / "done.json"
    done = json.loads(done_path.read_text()) if done_path.exists() else {}
    agents = {}
    for agent in spec.exp.agents:
        key = f"{agent.name}/eval_accuracy"
        curve = [(int(r["step"]), r[key]) for r in rows if key in r]
        if not curve:
            raise CompareError(f"{path}: no {key!r} rows (was evaluation on?)")
        # the cross window exists only in HACPO (Naive clips cross samples with the self clip, docs/algorithm.md §8)
        clip = [r[f"{agent.name}/hacpo/cross_clipfrac"] for r in rows if spec.exp.hacpo.algorithm == "hacpo"
                and f"{agent.name}/hacpo/cross_clipfrac" in r and r.get(f"{agent.name}/hacpo/num_cross", 0) > 0]
        self_clip = [r[f"{agent.name}/hacpo/self_clipfrac"] for r in rows if f"{agent.name}/hacpo/self_clipfrac" in r]
        agents[agent.name] = AgentRun(steps=[s for s, _ in curve], accuracy=[v for _, v in curve],
                                      start=curve[0][1], final=curve[-1][1],
                                      cross_clipfrac_mean=_mean_or_none(clip),
                                      self_clipfrac_mean=_mean_or_none(self_clip))
    agents.update(family_results(rows, [a.name for a in spec.exp.agents]))
    step_times = [r["time/rollout_s"] + r["time/train_s"] for r in rows if "time/train_s" in r]
    return RunResult(method=spec.method, seed=spec.seed, final_step=int(rows[-1]["step"]),
                     rollouts_per_agent=rollouts_per_agent(spec.exp), wall_s=done.get("wall_s"),
                     rollout_train_s_per_step=sum(step_times) / len(step_times) if step_times else None,
                     agents=agents)


def reported_names(specs: list[RunSpec], results: list[RunResult]) -> list[str]:
    """The agents of the comparison, then their per-family entries (:func:`family_results`) in first-seen order."""
    names = [a.name for a in specs[0].exp.agents]
    families = [n for r in results for n in r.agents if n not in names]
    return names + sorted(set(families), key=families.index)


def write_outputs(specs: list[RunSpec], results: list[RunResult], out: Path, methods: list[str],
                  baselines: list[str] | None = None, last: int = 1) -> dict[str, MethodSummary]:
    """Write compare.md / compare.json / compare.png for ``results`` under ``out``; returns the summary.

    ``results``: the runs of ``specs`` (:func:`run_result`), plus any finished runs of earlier
    comparisons (:func:`merge_included`). compare.md: the summary table, one row per seed, and (with
    two or more methods) the paired differences against each of ``baselines`` (default: the first
    method), on the final evaluation and, with ``last`` > 1, on the mean of the last ``last``
    evaluations; then the per-pair cross statistics of the HACPO runs of ``specs`` (clipped share by
    advantage sign, adaptive centre, median log s)."""
    from hacrl_megatron.trainer.metrics import read_metrics

    agents_only = [a.name for a in specs[0].exp.agents]
    agent_names = reported_names(specs, results)  # with the per-family entries of a task with families
    baselines = baselines or [methods[0]]
    summary = summarise(results, methods, agent_names)
    table = markdown_table(summary, agent_names) + "\n"
    if len(methods) > 1:
        table += report_tables(results, methods, baselines, agent_names, last)
    else:
        table += per_seed_table(results, methods, agent_names)
    runs = {m: [(x.exp.hacpo.algorithm, read_metrics(x.out_dir / "metrics.jsonl")) for x in specs if x.method == m]
            for m in methods}
    table += cross_sections(runs, agents_only)
    (out / "compare.md").write_text(table)
    data = {"summary": {m: asdict(entry) for m, entry in summary.items()}, "runs": [asdict(r) for r in results]}
    (out / "compare.json").write_text(json.dumps(data, indent=1))
    plot_summary(summary, agent_names, out / "compare.png")
    if len(methods) > 1:
        plot_paired(results, methods, baselines, agent_names, out / "compare_paired.png")
    return summary


# --------------------------------------------------------------------------------------------
# command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu_demo", help="built-in preset name or YAML path (default cpu_demo)")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   help=f"algorithms to compare (default {' '.join(DEFAULT_METHODS)}; also gspo, grpo, and the "
                        f"HACPO variants {' '.join(VARIANTS)})")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4],
                   help="train.seed values (default 0 1 2 3 4); each seed's methods share one warm-up")
    p.add_argument("--baseline", nargs="+", default=None, dest="baselines", metavar="METHOD",
                   help="method(s) the paired differences are taken against, one table each "
                        "(default: the first of --methods)")
    p.add_argument("--last", type=int, default=1, metavar="K",
                   help="also report paired differences on the mean of each run's last K greedy evaluations "
                        "(less evaluation noise than the final one; default 1: final only)")
    p.add_argument("--include", nargs="+", type=Path, default=[], metavar="COMPARE_JSON",
                   help="also report the runs of earlier comparisons (their compare.json) for --methods × "
                        "--seeds that --out lacks; a run both hold must have identical curves (same warm-up)")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: rebuild compare.md/json/png from the finished runs under --out "
                        "(e.g. after running one seed per invocation); unfinished runs are listed and left out")
    p.add_argument("--set", nargs="*", default=[], dest="sets", metavar="key=value",
                   help="dotted overrides for every run, e.g. train.steps=40 agents.0.backend=hf")
    p.add_argument("--out", type=Path, default=Path("runs/compare"), help="output folder (default runs/compare)")
    p.add_argument("--jobs", type=int, default=2, help="parallel processes (1: everything in this process)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: must be >= 1")
    for base in args.baselines or []:
        if base not in args.methods:
            p.error(f"--baseline {base}: must be one of --methods {args.methods}")
    if args.last < 1:
        p.error(f"--last {args.last}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, MethodSummary]:
    """Plan, warm up, train (skipping finished runs), then write the table and plot; returns the summary."""
    args = parse_args(argv)
    out = args.out.resolve()
    specs = plan_runs(args.preset, args.methods, args.seeds, args.sets, out)
    start = time.time()
    if args.report_only:
        specs = finished_runs(specs)
        methods = [m for m in args.methods if any(s.method == m for s in specs)]
    else:
        warm = check_shared_warmup(specs)
        for seed, dirs in warm.items():
            shared = ", ".join(str(d) if d else "none (no warm-up)" for d in dirs)
            print(f"[compare] seed {seed}: every method starts from warm-up {shared}", flush=True)
        execute(plan_tasks(args.preset, specs, warm), args.jobs)
        methods = args.methods
        print(f"[compare] all runs finished in {time.time() - start:.0f} s\n")
    results = [run_result(s) for s in specs]
    if args.include:
        agent_names = reported_names(specs, results)
        included = merge_included(results, args.include, args.methods, args.seeds, agent_names)
        results += included
        methods = [m for m in args.methods if m in methods or any(r.method == m for r in included)]
    baselines = [b for b in (args.baselines or [methods[0]]) if b in methods]
    summary = write_outputs(specs, results, out, methods, baselines, args.last)
    print((out / "compare.md").read_text())
    print(f"[compare] wrote {out / 'compare.md'}, {out / 'compare.json'}, {out / 'compare.png'}")
    return summary


if __name__ == "__main__":  # guarded: the pool's spawned processes import this file as a module
    try:
        main()
    except (CompareError, ConfigError) as err:  # bad input: the message names the option or file
        sys.exit(f"compare.py: error: {err}")
