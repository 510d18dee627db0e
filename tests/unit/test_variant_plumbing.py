"""The plumbing of the HACPO variants (the algorithm object's per-pair state, algo/algorithm.py) and the GPU-cluster projection of
benchmarks/bench_step_cost.py: pure functions, hand-computed values."""

import importlib.util
import math
from pathlib import Path

import pytest

from hacrl_megatron.algo import CapabilityTracker, build_algorithm, name_pair_metrics
from hacrl_megatron.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_pair_metrics_get_agent_names():
    metrics = {"cross_clipfrac/1/pos": 0.5, "cross_clipfrac/1/neg": 0.25, "cross_center/0": -0.1,
               "cross_log_ratio_median/1": 0.3, "cross_clipfrac": 0.4, "loss": 1.0}
    assert name_pair_metrics(metrics, ["llama", "qwen3"]) == {
        "cross_clipfrac/qwen3/pos": 0.5, "cross_clipfrac/qwen3/neg": 0.25, "cross_center/llama": -0.1,
        "cross_log_ratio_median/qwen3": 0.3, "cross_clipfrac": 0.4, "loss": 1.0}


def test_cross_centers_follow_the_tracker_medians():
    def algorithm(*overrides):
        return build_algorithm(load_config("cpu_demo", list(overrides)).hacpo, 2)

    adaptive = algorithm("hacpo.cross_window=adaptive")
    tracker = CapabilityTracker(2)
    assert algorithm().cross_centers(tracker) is None  # fixed window
    assert adaptive.cross_centers(tracker).tolist() == [[0.0, 0.0], [0.0, 0.0]]  # no history yet
    adaptive.record_cross_statistics(tracker, {"llama/hacpo/cross_log_ratio_median/qwen3": -0.5,
                                               "qwen3/hacpo/cross_log_ratio_median/llama": -0.1}, ["llama", "qwen3"])
    c = adaptive.cross_centers(tracker)
    assert c[0, 1].item() == pytest.approx(-0.5 - 0.5 * math.log(0.8))  # outside [log 0.8, 0]: centred
    assert c[1, 0].item() == 0.0 and c[0, 0].item() == 0.0  # inside: the paper's window
    naive = algorithm("hacpo.cross_window=adaptive", "hacpo.algorithm=naive")
    assert naive.cross_centers(tracker) is None  # only HACPO's cross term has the window
    before = tracker.state_dict()
    naive.record_cross_statistics(tracker, {"llama/hacpo/cross_log_ratio_median/qwen3": -0.5}, ["llama", "qwen3"])
    assert tracker.state_dict() == before  # nor records its statistics


def test_gpu_projection_of_the_step():
    spec = importlib.util.spec_from_file_location("bench_step_cost", ROOT / "benchmarks" / "bench_step_cost.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    agent = lambda recompute, train: {"layout": {"recompute": recompute},  # noqa: E731
                                      "time_s": {"rollout_s": 10.0, "gspo_x2_rollout_s": 20.0, "train_s": train,
                                                 "sync_s": 1.0}}
    plan = {"agents": [agent("none", 16.0), agent("full", 20.0)]}
    out = bench.project(plan, train_factor=1.0)
    # none: 16·(6 + 1)/8 = 14 ; full: 20·(8 + 1)/10 = 18 → the slower agent's 18 against 20
    assert out["train"] == {"hacpo_s": 18.0, "gspo_x2_s": 20.0, "ratio": 0.9}
    assert out["rollout"]["ratio"] == 0.5 and out["step"]["hacpo_s"] == 10.0 + 18.0 + 1.0
    assert bench.project(plan, train_factor=9 / 8)["train"]["hacpo_s"] == pytest.approx(20.0)  # break-even
    # decoupled (§5d): the old pass covers both agents' responses: none 16·(6 + 2)/8 = 16, full 20·(8 + 2)/10 = 20
    decoupled = bench.project(plan, train_factor=1.0, cross_old_pass=True)
    assert decoupled["train"]["hacpo_s"] == pytest.approx(20.0) and decoupled["step"]["ratio"] == pytest.approx(31 / 41)
