"""Where do the cross ratios of a trained pair sit, for correct and for wrong answers? (docs/algorithm.md §5-5b)

    python benchmarks/diagnose_cross_ratios.py [RUN_DIR] [--preset cpu_demo] [--prompts 48] [--samples 8]
                                               [--seed 1234] [--json OUT.json] [--metrics RUN ...] [--first 3]

Loads the final agents of a finished ``hacrl train`` (``RUN_DIR/final/<agent>``; without RUN_DIR the
preset's starting agents, e.g. to check a pair of very different tokenizers), lets each sample
``--samples`` responses for ``--prompts`` training-distribution prompts (offset past the run's
training prompts, never the evaluation set), scores them with the shared verifier, and computes every
response's log-probability under its author (π^(j), its own tokens) and under every other agent
(π^(k), re-tokenized exactly as in training: ``Exchange.views``), at the rollout temperature.

For each learner k and source j ≠ k it reports, separately for correct (R > 0) and wrong answers,
the share of cross samples with s > 1, s in [1 − δ, 1] and s < 1 − δ, with s the sequence ratio of
eq. 11 (per-token normalised), and the median log s normalised per token (eq. 11) and per UTF-8
byte of the response text (Σ log π / bytes on both sides), to tell whether tokenizer granularity
drives the ratios. On a task with problem families (``add_sub_cot``) each of these rows is also split by
the prompt's family (``adder on subtractor / sub / correct``): where a source's correct answers on its
strong family sit in the other learner's window (``cpu_complement``, docs/algorithm.md §10b).

Next to the paper's Table 6 (the cross-agent sequence ratio s of its runs: mean 0.896, range
0.862-0.936) it prints the distribution of s per learner over all cross samples: mean, the 5/25/50/75/95 %
quantiles and the fraction inside the cross window [1 − δ, 1]. ``--metrics RUN ...`` adds the same
comparison over training from finished runs' ``metrics.jsonl`` (any preset): per learner the mean of
``<agent>/hacpo/cross_ratio_mean`` over the first ``--first`` steps, over all steps, its range over
steps, and how far the first steps' mean lies outside the paper's range widened by ±0.05
(0 when inside). With ``--metrics`` alone (``--no-sample``) nothing is sampled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hacrl_megatron.config import load_config  # noqa: E402
from hacrl_megatron.trainer import loop, stages  # noqa: E402
from hacrl_megatron.trainer.metrics import read_metrics  # noqa: E402

# the paper's Table 6: the cross-agent sequence ratio s, mean and range over its runs
PAPER_MEAN, PAPER_RANGE, BAND_MARGIN = 0.896, (0.862, 0.936), 0.05
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def build(run_dir: Path | None, preset: str, sets: list[str], seed: int) -> loop.Run:
    """The run's config with every agent starting from its exported final weights, no warm-up; with
    ``run_dir=None`` the preset's own starting agents (its warm-up, or pretrained weights)."""
    if run_dir is None:
        return loop.setup(load_config(preset, [*sets, "log.progress=false", "log.tensorboard=false"]))
    exp = load_config(preset, [*sets, "train.sft_warmup=false", f"train.seed={seed}", "log.progress=false",
                               "log.tensorboard=false", f"output_dir={run_dir / 'diagnosis'}"])
    agents = []
    for a in exp.agents:
        final = run_dir / "final" / a.name
        if not final.is_dir():
            raise SystemExit(f"{final}: missing; RUN_DIR must be a finished `hacrl train` output folder")
        agents.append(dataclasses.replace(a, init_checkpoint=str(final)))
    return loop.setup(dataclasses.replace(exp, agents=agents))


def score_pairs(run: loop.Run, prompts: int) -> list[dict[str, Any]]:
    """One record per (learner, cross sample): reward, token- and byte-normalised log s."""
    exp = run.exp
    offset = exp.train.steps * exp.train.prompts_per_step  # past every prompt the run trained on
    records = run.task.sample(prompts, offset=offset)
    family = {r.id: (run.task.family_of(r) if getattr(run.task, "families", ()) else None) for r in records}
    data = stages.verify(run.verifier, records, stages.rollout(run.runtimes, records, exp, run.algorithm, step=10**6),
                         10**6, exp.rollout.max_response_len + 1)
    # Σ log π^(j) of each response, its own tokens
    stages.old_logprobs(run.runtimes, data, run.exchange, run.algorithm, exp.rollout.temperature)
    out = []
    for rt in run.runtimes:
        ids = stages.prompt_id_map(rt, data.prompts)
        for src in run.runtimes:
            if src.index == rt.index:
                continue
            trajs = data.trajectories[src.name]
            views = run.exchange.views(rt.name, trajs, ids, record_stats=False)
            keep = [i for i, v in enumerate(views) if v.response_len > 0 and trajs[i].source_len > 0]
            sums, lens = rt.trainer.sequence_logprobs(stages.views_to_batch([views[i] for i in keep]),
                                                    exp.rollout.temperature)
            for i, s_k, l_k in zip(keep, sums.tolist(), lens.tolist()):
                t = trajs[i]
                n_bytes = max(len(t.response_text.encode("utf-8")), 1)
                out.append({"learner": rt.name, "source": src.name, "correct": t.reward > 0,
                            "family": family.get(t.prompt_id),
                            "log_s_token": s_k / l_k - t.source_logp_sum / t.source_len,
                            "log_s_byte": (s_k - t.source_logp_sum) / n_bytes})
    return out


def summarise(rows: list[dict[str, Any]], low: float) -> dict[str, Any]:
    import math

    out: dict[str, Any] = {}
    families = sorted({r.get("family") for r in rows} - {None})
    for key in sorted({(r["learner"], r["source"]) for r in rows}):
        for family, correct in [(None, c) for c in (True, False)] + [(f, c) for f in families for c in (True, False)]:
            sel = [r for r in rows if (r["learner"], r["source"]) == key and r["correct"] == correct
                   and (family is None or r.get("family") == family)]
            if not sel:
                continue
            s = [math.exp(r["log_s_token"]) for r in sel]
            part = "" if family is None else f"{family} / "
            out[f"{key[0]} on {key[1]} / {part}{'correct' if correct else 'wrong'}"] = {
                "n": len(sel),
                "frac_s_above_1": sum(v > 1 for v in s) / len(s),
                "frac_in_window": sum(low <= v <= 1 for v in s) / len(s),
                "frac_below_window": sum(v < low for v in s) / len(s),
                "median_log_s_token": statistics.median(r["log_s_token"] for r in sel),
                "median_log_s_byte": statistics.median(r["log_s_byte"] for r in sel),
            }
    return out


def distribution(rows: list[dict[str, Any]], low: float) -> dict[str, dict[str, float]]:
    """Per learner (over every source and answer): n, mean s, quantiles of s and the fraction in [low, 1]."""
    import math

    out = {}
    for learner in sorted({r["learner"] for r in rows}):
        s = sorted(math.exp(r["log_s_token"]) for r in rows if r["learner"] == learner)
        cuts = statistics.quantiles(s, n=100, method="inclusive") if len(s) > 1 else s * 99
        out[learner] = {"n": len(s), "mean": statistics.fmean(s),
                        **{f"q{int(q * 100):02d}": cuts[int(q * 100) - 1] for q in QUANTILES},
                        "frac_in_window": sum(low <= v <= 1 for v in s) / len(s)}
    return out


def band_distance(value: float) -> float:
    """How far ``value`` lies outside the paper's range widened by ±BAND_MARGIN (0 inside)."""
    lo, hi = PAPER_RANGE[0] - BAND_MARGIN, PAPER_RANGE[1] + BAND_MARGIN
    return max(lo - value, value - hi, 0.0)


def training_ratios(run_dirs: list[Path], first: int) -> dict[str, dict[str, float]]:
    """Per learner, ``<agent>/hacpo/cross_ratio_mean`` of finished runs' metrics.jsonl: the mean over the
    first ``first`` steps and over all steps (means over runs), the lowest and highest step value."""
    series: dict[str, list[list[float]]] = {}
    for run_dir in run_dirs:
        path = run_dir / "metrics.jsonl"
        if not path.is_file():
            raise SystemExit(f"{path}: missing; --metrics takes `hacrl train` output folders")
        rows = read_metrics(path)
        for key in sorted({k for row in rows for k in row if k.endswith("/hacpo/cross_ratio_mean")}):
            values = [row[key] for row in rows if key in row]
            series.setdefault(key.split("/")[0], []).append(values)
    if not series:
        raise SystemExit(f"{[str(d) for d in run_dirs]}: no <agent>/hacpo/cross_ratio_mean logged "
                         "(a method that shares rollouts logs it: hacpo, naive, naive_merge)")
    out = {}
    for agent, runs in series.items():
        start = statistics.fmean(statistics.fmean(v[:first]) for v in runs)
        out[agent] = {"runs": len(runs), "steps": max(len(v) for v in runs), "first_steps_mean": start,
                      "all_steps_mean": statistics.fmean(statistics.fmean(v) for v in runs),
                      "step_min": min(min(v) for v in runs), "step_max": max(max(v) for v in runs),
                      "first_steps_outside_band": band_distance(start)}
    return out


def print_tables(summary: dict[str, Any], dist: dict[str, Any], train: dict[str, Any], low: float, first: int) -> None:
    paper = f"{PAPER_MEAN} ({PAPER_RANGE[0]}-{PAPER_RANGE[1]})"
    if summary:
        print("| learner on source / answers | n | s > 1 | s in [1−δ, 1] | s < 1−δ | median log s (token) | "
              "median log s (byte) |")
        print("|---|---|---|---|---|---|---|")
        for name, v in summary.items():
            print(f"| {name} | {v['n']} | {v['frac_s_above_1']:.2f} | {v['frac_in_window']:.2f} | "
                  f"{v['frac_below_window']:.2f} | {v['median_log_s_token']:+.3f} | {v['median_log_s_byte']:+.3f} |")
        print(f"\n| learner (all cross samples) | n | mean s | q05 | q25 | q50 | q75 | q95 | in [{low:g}, 1] | "
              "Table 6 mean (range) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, v in dist.items():
            print(f"| {name} | {v['n']} | {v['mean']:.3f} | {v['q05']:.3f} | {v['q25']:.3f} | {v['q50']:.3f} | "
                  f"{v['q75']:.3f} | {v['q95']:.3f} | {v['frac_in_window']:.2f} | {paper} |")
    if train:
        print(f"\n| learner (training) | runs | steps | cross_ratio_mean, first {first} steps | all steps | "
              "step min | step max | outside Table 6 ±0.05 | Table 6 mean (range) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, v in train.items():
            print(f"| {name} | {v['runs']} | {v['steps']} | {v['first_steps_mean']:.3f} | {v['all_steps_mean']:.3f} | "
                  f"{v['step_min']:.3f} | {v['step_max']:.3f} | {v['first_steps_outside_band']:.3f} | {paper} |")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, nargs="?", default=None,
                   help="a finished run's output folder; omitted: the preset's starting agents")
    p.add_argument("--preset", default="cpu_demo")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234, help="sampling seed (train.seed of the diagnosis)")
    p.add_argument("--set", nargs="*", default=[], dest="sets", metavar="key=value")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--metrics", type=Path, nargs="+", default=[], metavar="RUN",
                   help="finished runs whose logged cross_ratio_mean to compare with Table 6")
    p.add_argument("--first", type=int, default=3, help="steps counted as the start of training (default 3)")
    p.add_argument("--no-sample", action="store_true", help="only the --metrics part: sample nothing")
    args = p.parse_args(argv)
    summary: dict[str, Any] = {}
    dist: dict[str, Any] = {}
    low = load_config(args.preset, list(args.sets)).hacpo.cross_clip_low
    if not args.no_sample:
        sets = [*args.sets, f"rollout.samples_per_prompt={args.samples}"]
        run = build(args.run_dir, args.preset, sets if args.run_dir else [*sets, f"train.seed={args.seed}"],
                    args.seed)
        try:
            rows = score_pairs(run, args.prompts)
        finally:
            run.verifier.close()
            for rt in run.runtimes:
                rt.close()
        summary, dist = summarise(rows, low), distribution(rows, low)
    train = training_ratios(args.metrics, args.first) if args.metrics else {}
    print_tables(summary, dist, train, low, args.first)
    out = {**summary, "distribution": dist, "training": train,
           "paper_table6": {"mean": PAPER_MEAN, "range": list(PAPER_RANGE), "band_margin": BAND_MARGIN}}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
