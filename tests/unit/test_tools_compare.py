"""tools/compare.py: a tiny real comparison (2 steps, 1 seed, hf backend, no warm-up), shared
warm-up checkpoints across methods, resumability and input errors."""

import importlib
import json
import re
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from hacrl_megatron.config import ConfigError

# imported by its package path (tools/ is a namespace package under the repository root), so the
# pool's spawned processes can import the task records and functions too
cmp = importlib.import_module("tools.compare")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
P, G, STEPS = 2, 2, 2
TINY = [
    "agents.0.backend=hf", "agents.1.backend=hf", "train.sft_warmup=false",
    "agents.0.model.hidden_size=32", "agents.0.model.num_layers=1", "agents.0.model.ffn_hidden_size=64",
    "agents.1.model.hidden_size=24", "agents.1.model.num_layers=1", "agents.1.model.ffn_hidden_size=48",
    f"train.steps={STEPS}", f"train.prompts_per_step={P}", f"rollout.samples_per_prompt={G}", "train.eval_every=1",
    "train.micro_batch_size=16", "train.verifier_workers=0", "rollout.max_response_len=4", "data.difficulty=1",
    "data.eval_size=4", "checkpoint.every=0",
]


@pytest.fixture(scope="module")
def tiny_compare(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    start = time.perf_counter()
    summary = cmp.main(["--seeds", "0", "--out", str(out), "--jobs", "1", "--set", *TINY])
    return out, summary, time.perf_counter() - start


def test_table_has_every_method_and_agent_and_right_rollout_counts(tiny_compare):
    out, summary, _ = tiny_compare
    assert list(summary) == ["hacpo", "gspo_x2", "naive"]
    for method, entry in summary.items():
        assert set(entry.agents) == {"llama", "qwen3"}
        g = 2 * G if method == "gspo_x2" else G
        for a in entry.agents.values():
            assert a.rollouts == P * g * STEPS
            assert a.curve_steps == [0, 1, 2]  # eval every step, start included
            assert a.delta[0] == pytest.approx(a.final[0] - a.start[0])
    for agent in ("llama", "qwen3"):  # one seed, one starting checkpoint: identical step-0 greedy accuracy
        assert len({tuple(summary[m].agents[agent].start_per_seed) for m in summary}) == 1
    assert summary["gspo_x2"].agents["llama"].rollouts == 2 * summary["hacpo"].agents["llama"].rollouts
    table = (out / "compare.md").read_text()
    for label in ("HACPO", "GSPO×2", "Naive"):
        for agent in ("llama", "qwen3"):
            assert sum(line.startswith(f"| {label} | {agent} |") for line in table.splitlines()) == 1
    assert f"| {P * 2 * G * STEPS} |" in table
    stored = json.loads((out / "compare.json").read_text())
    assert {(r["method"], r["seed"]) for r in stored["runs"]} == {("hacpo", 0), ("gspo_x2", 0), ("naive", 0)}
    assert stored["summary"]["hacpo"]["agents"]["llama"]["rollouts"] == P * G * STEPS
    assert cmp.load_results(out / "compare.json")[0] == summary
    assert (out / "compare.png").read_bytes().startswith(b"\x89PNG")


def test_each_run_has_its_own_dir_with_final_step_and_done_marker(tiny_compare):
    out, _, _ = tiny_compare
    for method in ("hacpo", "gspo_x2", "naive"):
        run = out / f"{method}-seed0"
        assert json.loads((run / "done.json").read_text())["steps"] == STEPS
        assert json.loads((run / "config.json").read_text())["hacpo"]["algorithm"] == method
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == STEPS
        # the learner's step batch: both agents' G responses (HACPO, Naive) or its own 2G (GSPO×2)
        assert rows[-1]["llama/sequences"] == P * G * 2


def test_rerun_skips_finished_runs(tiny_compare, capsys):
    out, summary, _ = tiny_compare
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("*/metrics.jsonl")}
    again = cmp.main(["--seeds", "0", "--out", str(out), "--jobs", "1", "--set", *TINY])
    assert capsys.readouterr().out.count("finished earlier, skipped") == 3
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("*/metrics.jsonl")} == before  # untouched
    assert again == summary


def _copy_compare(source: Path, out: Path) -> Path:
    """A copy of a finished comparison whose runs record their new folders (tests that change runs use one)."""
    shutil.copytree(source, out)
    for path in out.glob("*-seed*/config.json"):
        path.write_text(path.read_text().replace(str(source), str(out)))
    return out


def test_runs_moved_or_linked_under_another_out_are_the_same_runs(tiny_compare, tmp_path):
    """Seeds run into separate folders are reported together by linking their runs under one --out: a run's
    recorded output_dir is not part of what makes it the same run."""
    source, summary, _ = tiny_compare
    moved = tmp_path / "moved copy"
    shutil.copytree(source, moved)  # config.json still records the old folders
    linked = tmp_path / "linked"
    linked.mkdir()
    for run in source.glob("*-seed*"):
        (linked / run.name).symlink_to(run)
    for out in (moved, linked):
        again = cmp.main(["--seeds", "0", "--out", str(out), "--report-only", "--set", *TINY])
        assert again == summary
        assert (out / "compare.md").read_text() == (source / "compare.md").read_text()


def test_a_folder_holding_a_different_run_is_refused(tiny_compare, tmp_path):
    out = _copy_compare(tiny_compare[0], tmp_path / "copy")
    (out / "hacpo-seed0" / "done.json").unlink()  # unfinished, so it would be (re)run ...
    with pytest.raises(cmp.CompareError, match="hacpo-seed0/config.json: holds a run with a different config"):
        cmp.main(["--seeds", "0", "--out", str(out), "--jobs", "1", "--set", *TINY, "hacpo.alpha=3"])


def test_methods_of_a_seed_share_the_warmup_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("HACRL_CACHE", str(tmp_path / "cache"))
    specs = cmp.plan_runs("cpu_demo", ["hacpo", "gspo_x2", "naive", "gspo", "grpo"], [0, 1], [], tmp_path)
    warm = cmp.check_shared_warmup(specs)
    assert set(warm) == {0, 1}
    for seed in (0, 1):
        dirs = warm[seed]
        assert len(dirs) == 2 and all(d is not None and d.parent == tmp_path / "cache" / "warmup" for d in dirs)
        assert all(cmp.warmup_dirs(s) == dirs for s in specs if s.seed == seed)
    assert warm[0] != warm[1]  # the key includes train.seed
    tasks = cmp.plan_tasks("cpu_demo", specs, warm)
    assert [(type(t), t.seed) for t in tasks[:2]] == [(cmp.WarmupTask, 0), (cmp.WarmupTask, 1)]  # one per seed, first
    assert [(t.method, t.seed) for t in tasks[2:]] == [(s.method, s.seed) for s in specs]
    assert tasks[2].log == specs[0].out_dir / "train.log" and tasks[0].log == tmp_path / "warmup-seed0.log"
    for d in warm[0]:  # seed 0 cached: only seed 1 still needs a warm-up task
        d.mkdir(parents=True)
        (d / "warmup.json").write_text("{}")
    assert [t.seed for t in cmp.plan_tasks("cpu_demo", specs, warm) if isinstance(t, cmp.WarmupTask)] == [1]
    for spec in specs:  # seed 1 finished (e.g. a re-run for the table): neither warm-up nor training again
        if spec.seed == 1:
            (spec.out_dir / "done.json").write_text("{}")
            (spec.out_dir / "metrics.jsonl").write_text(json.dumps({"step": spec.exp.train.steps}) + "\n")
    assert {t.seed for t in cmp.plan_tasks("cpu_demo", specs, warm)} == {0}


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(cmp.CompareError, match=r"--methods: unknown \['ppo'\]"):
        cmp.plan_runs("cpu_demo", ["hacpo", "ppo"], [0], [], tmp_path)
    with pytest.raises(cmp.CompareError, match="sets hacpo.algorithm itself"):
        cmp.plan_runs("cpu_demo", ["hacpo"], [0], ["hacpo.algorithm=naive"], tmp_path)
    with pytest.raises(cmp.CompareError, match="needs greedy evaluation"):
        cmp.plan_runs("cpu_demo", ["hacpo"], [0], ["train.eval_every=0"], tmp_path)
    with pytest.raises(ConfigError, match="train.steps"):
        cmp.plan_runs("cpu_demo", ["hacpo"], [0], ["train.steps=-1"], tmp_path)
    with pytest.raises(cmp.CompareError, match="duplicates"):
        cmp.plan_runs("cpu_demo", ["hacpo"], [0, 0], [], tmp_path)


@pytest.mark.parametrize("name", ["COMPARE_cpu_demo.json", "COMPARE_cpu_demo_hf.json", "COMPARE_variants_a.json",
                                  "COMPARE_variants_b.json", "COMPARE_variants_c.json",
                                  "COMPARE_variants_b_ablations.json", "COMPARE_variants_gspo_clip_a.json",
                                  "COMPARE_variants_gspo_clip_b.json", "COMPARE_variants_gspo_clip_c.json", "COMPARE_variants_gspo_clip_confirm_a.json",
                                  "COMPARE_variants_gspo_clip_confirm_b.json",
                                  "COMPARE_variants_gspo_clip_a_ablations.json",
                                  "COMPARE_variants_gspo_clip_b_ablations.json",
                                  "COMPARE_variants_decoupled_a.json", "COMPARE_variants_decoupled_b.json",
                                  "COMPARE_variants_decoupled_a_no_omega.json",
                                  "COMPARE_variants_decoupled_b_no_omega.json",
                                  "COMPARE_variants_decoupled_confirm_a.json",
                                  "COMPARE_variants_decoupled_confirm_b.json"])
def test_stored_results_load_into_records_and_write_back_unchanged(name):
    text = (BENCHMARKS / name).read_text()
    summary, runs = cmp.load_results(BENCHMARKS / name)
    again = {"summary": {m: asdict(e) for m, e in summary.items()}, "runs": [asdict(r) for r in runs]}
    assert json.dumps(again, indent=1) == json.dumps(json.loads(text), indent=1)
    agents = list(runs[0].agents)
    assert cmp.summarise(runs, list(summary), agents) == summary  # the stored summary follows from the runs
    if name == "COMPARE_cpu_demo.json":  # the report quotes the generated tables
        report = (BENCHMARKS / "COMPARE_cpu_demo.md").read_text()
        assert all(line in report for line in cmp.markdown_table(summary, agents).splitlines())


def test_mean_std_is_unbiased():
    assert cmp.mean_std([0.5, 0.7, 0.9]) == pytest.approx((0.7, 0.2))
    assert cmp.mean_std([0.4]) == (0.4, 0.0)


@pytest.mark.slow
def test_parallel_child_processes_give_the_same_table_as_in_process(tiny_compare, tmp_path, capfd):
    out, summary, _ = tiny_compare
    capfd.readouterr()
    parallel = cmp.main(["--seeds", "0", "--out", str(tmp_path / "par"), "--jobs", "2", "--set", *TINY])
    printed = capfd.readouterr().out  # queued at submission, started by the child, done with the run's own time
    for method in summary:
        label = f"{method} seed 0"
        assert f"[compare] queued {label}" in printed and f"[compare] started {label}\n" in printed, printed
        assert re.search(rf"\[compare\] {re.escape(label)}: done in \d+ s \(\d+ s after it was queued\)", printed)
    for method in summary:
        for agent in ("llama", "qwen3"):
            a, b = summary[method].agents[agent], parallel[method].agents[agent]
            assert (a.curve_steps, a.curve_mean, a.rollouts) == (b.curve_steps, b.curve_mean, b.rollouts)
    assert "step" in (tmp_path / "par" / "gspo_x2-seed0" / "train.log").read_text()


@pytest.mark.slow
def test_a_failing_pool_task_names_its_log(tmp_path, capfd):
    bad = cmp.TrainTask("no_such_preset", (), 0, "hacpo", tmp_path / "run", tmp_path / "run" / "train.log")
    with pytest.raises(RuntimeError, match=r"hacpo seed 0 failed; see .*train.log"):
        cmp.execute([bad], jobs=2)
    printed = capfd.readouterr().out
    assert "[compare] started hacpo seed 0\n" in printed and "[compare] hacpo seed 0: FAILED (" in printed, printed
    assert "no_such_preset" in bad.log.read_text()  # the child's traceback is in the log


def test_paired_differences_and_per_seed_table_from_stored_runs():
    _, runs = cmp.load_results(BENCHMARKS / "COMPARE_cpu_demo.json")
    finals = {(r.method, r.seed): r.agents["llama"].final for r in runs}
    d = cmp.paired_differences(runs, "hacpo", "gspo_x2", "llama")
    assert d.seeds == [0, 1, 2]
    assert d.diffs == [finals[("hacpo", s)] - finals[("gspo_x2", s)] for s in (0, 1, 2)]
    mean, std = d.mean_std
    assert mean == pytest.approx(sum(d.diffs) / 3)
    assert std == pytest.approx((sum((x - mean) ** 2 for x in d.diffs) / 2) ** 0.5)
    assert sum(d.favour) == 3 and d.favour[0] == sum(x > 0 for x in d.diffs)
    partial = [r for r in runs if not (r.method == "naive" and r.seed == 1)]  # an unfinished run drops its seed
    assert cmp.paired_differences(partial, "naive", "hacpo", "qwen3").seeds == [0, 2]
    table = cmp.per_seed_table(runs, ["hacpo", "gspo_x2", "naive"], ["llama", "qwen3"])
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 3 and rows[0].startswith(f"| 0 | {finals[('hacpo', 0)]:.3f} |")
    paired = cmp.paired_table(runs, ["hacpo", "gspo_x2", "naive"], "hacpo", ["llama", "qwen3"])
    assert sum(line.startswith("| GSPO×2 − HACPO | llama |") for line in paired.splitlines()) == 1
    assert "| HACPO − HACPO" not in paired  # the baseline has no row against itself


def test_hacpo_variants_are_methods_with_their_overrides(tmp_path):
    specs = cmp.plan_runs("cpu_demo", ["hacpo", "hacpo+pessimistic", "hacpo+adaptive", "hacpo+both",
                                       "hacpo+gspo_clip", "hacpo+decoupled"], [3], [], tmp_path)
    got = {s.method: (s.exp.hacpo.algorithm, s.exp.hacpo.cross_clip_mode, s.exp.hacpo.cross_window) for s in specs}
    assert got == {"hacpo": ("hacpo", "clamp", "fixed"), "hacpo+pessimistic": ("hacpo", "pessimistic", "fixed"),
                   "hacpo+adaptive": ("hacpo", "clamp", "adaptive"), "hacpo+both": ("hacpo", "pessimistic", "adaptive"),
                   "hacpo+gspo_clip": ("hacpo", "gspo", "fixed"), "hacpo+decoupled": ("hacpo", "decoupled", "fixed")}
    assert len(set(map(tuple, cmp.check_shared_warmup(specs).values()))) == 1  # one warm-up for all six
    assert specs[1].out_dir == tmp_path / "hacpo+pessimistic-seed3"


def test_report_only_rebuilds_from_finished_runs_with_several_baselines_and_last_k(tiny_compare, tmp_path, capsys):
    source, summary, _ = tiny_compare
    out = _copy_compare(source, tmp_path / "copy")
    # a run recorded by an earlier version, before data.checker existed, is still the same run
    old = json.loads((out / "hacpo-seed0" / "config.json").read_text())
    assert old["data"].pop("checker") is None
    (out / "hacpo-seed0" / "config.json").write_text(json.dumps(old))
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*-seed0/metrics.jsonl")}
    again = cmp.main(["--seeds", "0", "1", "--out", str(out), "--report-only", "--baseline", "hacpo", "naive",
                      "--last", "2", "--set", *TINY])
    assert again == summary  # seed 1 never ran: left out, seed 0 unchanged
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*-seed0/metrics.jsonl")} == before  # nothing retrained
    assert "hacpo-seed1: not finished" in capsys.readouterr().out
    table = (out / "compare.md").read_text()
    assert "Paired by seed against HACPO (final greedy accuracy)" in table
    assert "Paired by seed against Naive (mean of the last 2 greedy evaluations)" in table
    assert sum(line.startswith("| HACPO − Naive | llama |") for line in table.splitlines()) == 2  # final + last-2
    assert "| Δ last-2 mean acc. (mean ± std) |" in table
    assert (out / "compare_paired.png").read_bytes().startswith(b"\x89PNG")
    _, runs = cmp.load_results(out / "compare.json")
    hacpo = next(r for r in runs if r.method == "hacpo").agents["llama"]
    last2 = next(r for r in cmp.last_k_mean(runs, 2) if r.method == "hacpo").agents["llama"]
    assert last2.final == pytest.approx((hacpo.accuracy[-1] + hacpo.accuracy[-2]) / 2)
    assert "| HACPO | llama ← qwen3 |" in table  # per-pair cross statistics of the HACPO run only
    assert "| Naive | llama ← qwen3 |" not in table
    with pytest.raises(cmp.CompareError, match="no finished run"):
        cmp.main(["--seeds", "7", "--out", str(out), "--report-only", "--set", *TINY])
    with pytest.raises(SystemExit):
        cmp.parse_args(["--last", "0"])
    with pytest.raises(SystemExit):
        cmp.parse_args(["--methods", "hacpo", "--baseline", "naive"])


def test_pair_stats_average_over_steps_then_seeds():
    seed_a = [{"step": 1, "l/hacpo/cross_clipfrac/q/pos": 0.2, "l/hacpo/cross_clipfrac/q/neg": 0.5,
               "l/hacpo/cross_center/q": 0.0, "l/hacpo/cross_log_ratio_median/q": -0.2},
              {"step": 2, "l/hacpo/cross_clipfrac/q/pos": 0.4, "l/hacpo/cross_clipfrac/q/neg": 0.7,
               "l/hacpo/cross_center/q": -0.1, "l/hacpo/cross_log_ratio_median/q": -0.4}]
    seed_b = [{"step": 1, "l/hacpo/cross_clipfrac/q/pos": 0.9, "l/hacpo/cross_clipfrac/q/neg": 0.1,
               "l/hacpo/cross_center/q": -0.3, "l/hacpo/cross_log_ratio_median/q": 0.0}]
    stats = {(s.learner, s.source): s for s in cmp.pair_stats("hacpo+adaptive", [seed_a, seed_b], ["l", "q"])}
    s = stats[("l", "q")]
    assert s.clipfrac_pos == pytest.approx((0.3 + 0.9) / 2)
    assert s.clipfrac_neg == pytest.approx((0.6 + 0.1) / 2)
    assert s.center_mean == pytest.approx((-0.05 - 0.3) / 2)
    assert s.center_last == pytest.approx((-0.1 - 0.3) / 2)
    assert s.log_ratio_median == pytest.approx((-0.3 + 0.0) / 2)
    assert stats[("q", "l")].clipfrac_pos is None  # no keys for that direction
    table = cmp.pair_table(list(stats.values()))
    assert table.splitlines()[2] == "| HACPO+adapt. | l ← q | 0.60 | 0.35 | -0.17, -0.20 | -0.15 |"
    assert len(table.splitlines()) == 3
    assert cmp.pair_table([stats[("q", "l")]]) == ""
    assert s.omega is None and s.grad_share is None  # neither logged: neither column


def test_pair_stats_report_omega_and_the_cross_grad_share_when_logged():
    seed_a = [{"step": 1, "l/hacpo/cross_clipfrac/q/pos": 0.25, "l/omega/q": 1.5, "l/omega/l": 1.0,
               "l/hacpo/cross_grad_share": 0.5},
              {"step": 2, "l/hacpo/cross_clipfrac/q/pos": 0.25, "l/omega/q": 0.5, "l/hacpo/cross_grad_share": 0.25}]
    seed_b = [{"step": 1, "l/hacpo/cross_clipfrac/q/pos": 0.5, "l/omega/q": 2.0, "l/hacpo/cross_grad_share": 1.0}]
    s = {(x.learner, x.source): x for x in cmp.pair_stats("hacpo", [seed_a, seed_b], ["l", "q"])}[("l", "q")]
    assert s.omega == (1.0 + 2.0) / 2  # over steps (1.5, 0.5 -> 1.0), then seeds: exact in binary
    assert s.grad_share == (0.375 + 1.0) / 2
    lines = cmp.pair_table([s]).splitlines()
    assert lines[0].endswith("| median log s | ω (mean) | cross_grad_share |")
    assert lines[2] == "| HACPO | l ← q | 0.38 | n/a | n/a, n/a | n/a | 1.50 | 0.69 |"


def test_cross_sections_report_the_peer_rows_of_the_peer_sharing_methods_only():
    """docs/algorithm.md §8a: per learner, peer rows, mean weight, truncated, filtered and clipped shares;
    HACPO's cross statistics stay in the per-pair table, and GRPO (no sharing) is in neither."""
    ftis_a = [{"step": 1, "l/hacpo/num_cross": 8.0, "l/hacpo/peer_weight_mean": 0.5, "l/hacpo/peer_truncfrac": 0.0,
               "l/hacpo/peer_filtered_frac": 0.25, "l/hacpo/cross_clipfrac": 0.0},
              {"step": 2, "l/hacpo/num_cross": 16.0, "l/hacpo/peer_weight_mean": 1.5, "l/hacpo/peer_truncfrac": 0.5,
               "l/hacpo/peer_filtered_frac": 0.75, "l/hacpo/cross_clipfrac": 0.5}]
    ftis_b = [{"step": 1, "l/hacpo/num_cross": 4.0, "l/hacpo/peer_weight_mean": 2.0, "l/hacpo/peer_truncfrac": 1.0,
               "l/hacpo/peer_filtered_frac": 0.0, "l/hacpo/cross_clipfrac": 0.25}]
    sgt = [{"step": 1, "l/hacpo/num_cross": 2.0, "l/hacpo/cross_clipfrac": 0.0}]
    hacpo = [{"step": 1, "l/hacpo/num_cross": 32.0, "l/hacpo/cross_clipfrac/q/pos": 0.25}]
    grpo = [{"step": 1, "l/hacpo/token_clipfrac": 0.1}]
    text = cmp.cross_sections({"ftis": [("ftis", ftis_a), ("ftis", ftis_b)], "mutual_sgt": [("mutual_sgt", sgt)],
                               "hacpo": [("hacpo", hacpo)], "grpo": [("grpo", grpo)]}, ["l", "q"])
    peers = text.split("### Peer responses")[1].splitlines()
    # over steps (12, 1.0, 0.25, 0.5, 0.25), then seeds: exact in binary
    assert "| F-TIS | l | 8.00 | 1.50 | 0.62 | 0.25 | 0.25 |" in peers
    assert "| Mutual RL: SGT | l | 2.00 | n/a | n/a | n/a | 0.00 |" in peers
    assert not any(line.startswith(("| HACPO |", "| GRPO |")) or "| q |" in line for line in peers)
    assert "| HACPO | l ← q | 0.25 |" in text.split("### Peer responses")[0]
    assert cmp.cross_sections({"grpo": [("grpo", grpo)]}, ["l", "q"]) == ""


def test_include_adds_missing_runs_of_an_earlier_comparison_and_refuses_unpairable_ones(tiny_compare, tmp_path,
                                                                                         capsys):
    out = _copy_compare(tiny_compare[0], tmp_path / "copy")
    stored = json.loads((out / "compare.json").read_text())
    earlier = tmp_path / "earlier.json"  # an earlier comparison that has the naive run, not this one
    earlier.write_text(json.dumps(stored))
    shutil.rmtree(out / "naive-seed0")
    cmp.main(["--seeds", "0", "--out", str(out), "--report-only", "--include", str(earlier), "--set", *TINY])
    printed = capsys.readouterr().out
    assert "naive seed 0: from --include (identical common run)" in printed
    _, runs = cmp.load_results(out / "compare.json")
    assert {r.method for r in runs} == {"hacpo", "gspo_x2", "naive"}
    assert next(r for r in runs if r.method == "naive") == cmp.RunResult.from_json(
        next(r for r in stored["runs"] if r["method"] == "naive"))
    # a common run whose curve differs: a different warm-up or code path, so nothing can be paired
    for run in stored["runs"]:
        if run["method"] == "hacpo":
            run["agents"]["llama"]["accuracy"][-1] += 0.5
    earlier.write_text(json.dumps(stored))
    with pytest.raises(cmp.CompareError, match=r"earlier.json: hacpo seed 0 differs from the run in --out"):
        cmp.main(["--seeds", "0", "--out", str(out), "--report-only", "--include", str(earlier), "--set", *TINY])
    earlier.write_text("{not json")
    with pytest.raises(cmp.CompareError, match=r"--include .*earlier.json: not a compare.json"):
        cmp.main(["--seeds", "0", "--out", str(out), "--report-only", "--include", str(earlier), "--set", *TINY])


def test_command_line_reports_bad_input_in_one_line_without_traceback(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "tools" / "compare.py"
    proc = subprocess.run([sys.executable, str(script), "--preset", "no_such_preset", "--report-only",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "compare.py: error: preset 'no_such_preset'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_each_method_keeps_its_colour_in_every_paired_panel(tmp_path, monkeypatch):
    import matplotlib.axes

    from tools.compare_report import plot_paired

    _, runs = cmp.load_results(BENCHMARKS / "COMPARE_cpu_demo.json")
    drawn: list[str] = []
    bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda self, *a, **kw: drawn.append(kw["color"]) or bar(self, *a, **kw))
    plot_paired(runs, ["hacpo", "gspo_x2", "naive"], ["hacpo", "naive"], ["llama", "qwen3"], tmp_path / "p.png")
    # panels (baseline hacpo: gspo_x2, naive) × 2 agents, then (baseline naive: hacpo, gspo_x2) × 2 agents
    assert drawn == ["C1", "C2"] * 2 + ["C0", "C1"] * 2
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


def test_parity_method_and_naive_merge_share_the_warmup(tmp_path):
    specs = cmp.plan_runs("cpu_demo", ["hacpo", "hacpo+parity", "naive_merge"], [3], [], tmp_path)
    parity = {s.method: s for s in specs}["hacpo+parity"].exp
    assert (parity.hacpo.kl_coef, parity.hacpo.kl_estimator) == (1e-3, "low_var_kl")
    assert (parity.rollout.eos_mode, parity.train.minibatch_order) == ("strip_all", "self_first")
    assert {s.method: s for s in specs}["naive_merge"].exp.hacpo.algorithm == "naive_merge"
    assert len(set(map(tuple, cmp.check_shared_warmup(specs).values()))) == 1


def test_paper_ablations_switch_one_mechanism_and_share_the_warmup(tmp_path):
    methods = ["hacpo", "gspo_x2", "hacpo-adv", "hacpo-omega", "hacpo-stepwise", "hacpo-clip"]
    specs = {s.method: s.exp.hacpo for s in cmp.plan_runs("cpu_state", methods, [3], [], tmp_path)}
    flags = ("capability_aware_advantage", "discrepancy_coefficient", "stepwise", "cross_clip")
    assert all(getattr(specs["hacpo"], f) for f in flags)
    for method, flag in zip(methods[2:], flags):
        assert specs[method].algorithm == "hacpo"
        assert [getattr(specs[method], f) for f in flags] == [f != flag for f in flags]
    plan = cmp.plan_runs("cpu_state", methods, [3, 4], [], tmp_path)
    by_seed = cmp.check_shared_warmup(plan)
    assert by_seed[3] != by_seed[4]  # every seed its own warm-up run, so its own two snapshots


def test_a_pool_worker_ends_when_compare_is_killed_outright(tmp_path):
    """kill -9 of tools/compare.py must not leave its pool workers training on: a worker re-parented away
    from it SIGTERMs itself (end_with_parent)."""
    import signal
    import subprocess
    import sys

    from hacrl_megatron.launch.slurm_ray import process_running

    root = Path(__file__).resolve().parents[2]
    worker = ("import os, time, tools.compare as c; c.end_with_parent(os.getppid(), poll_s=0.1, grace_s=5); "
              "time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               f"p = subprocess.Popen([sys.executable, '-c', {worker!r}]); "
                               "print(p.pid, flush=True); time.sleep(120)"],
                              cwd=root, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(3.0)  # the worker imports tools.compare and starts watching
    assert process_running(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while process_running(child):
        assert time.monotonic() < deadline, "the worker outlived its killed parent"
        time.sleep(0.1)


def test_a_task_with_families_is_reported_per_agent_and_family():
    rows = [{"step": 0, "a/eval_accuracy": 0.5, "a/eval/add/accuracy": 0.8, "a/eval/sub/accuracy": 0.2,
             "b/eval_accuracy": 0.4, "b/eval/add/accuracy": 0.1, "b/eval/sub/accuracy": 0.7},
            {"step": 5, "a/eval_accuracy": 0.6, "a/eval/add/accuracy": 0.9, "a/eval/sub/accuracy": 0.3,
             "b/eval/add/accuracy": 0.2, "b/eval/sub/accuracy": 0.75}]
    got = cmp.family_results(rows, ["a", "b"])
    assert list(got) == ["a/add", "a/sub", "b/add", "b/sub"]
    assert (got["a/sub"].steps, got["a/sub"].accuracy, got["a/sub"].start, got["a/sub"].final) == ([0, 5], [0.2, 0.3],
                                                                                                   0.2, 0.3)
    assert got["b/add"].cross_clipfrac_mean is None
    assert cmp.family_results([{"step": 0, "a/eval_accuracy": 0.5}], ["a"]) == {}  # no families: nothing added
