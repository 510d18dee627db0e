"""Every method and ablation trains as it did before the algorithm became one object (algo/algorithm.py).

tests/fixtures/method_golden.json holds 3 steps of per-step metrics (losses, ratios, clip fractions,
gradient norms, rewards, ω, sync checks) of each case of ``tests.fixtures.method_golden.CASES`` on
both backends, recorded with the trainer as it was before the refactor. Regenerate only when a change
of the training maths is intended: ``python -m tests.fixtures.method_golden tests/fixtures/method_golden.json``.

The recording is float32 arithmetic from one machine. Another x86-64 CPU (or another
``ATEN_CPU_CAPABILITY``: default, AVX2, AVX-512) runs other vector kernels, which sum in another
order and round the last bits differently, so each metric is compared by what it is
(:func:`metric_kind`):

- **counted** metrics (tokens, sequences, rewards, clipped samples, the capability and ω built from
  rewards, schedules) are integers or ratios of integers and must be equal. They are the same on every
  ISA because the sampled tokens are: a draw could flip only if its uniform variate fell within float32
  rounding (~1e-7) of a CDF boundary, which happens in none of the 26 cases × 3 steps on default, AVX2
  and AVX-512 (checked); if it ever does, every later metric differs and the failure says so.
- **continuous** metrics (losses, ratios, log-probs, gradient norms, advantages) are float32 reductions
  over at most a few hundred terms (sequence log-prob sums of ≤ 16 tokens, each a log-softmax over
  ≤ 256 logits of ≤ 64-term dot products) and three Adam steps. Across ISAs they differ by at most
  9.3e-7 relative (measured between the recording and default/AVX2/AVX-512 runs on one AVX-512 CPU).
  They are compared within ``CONTINUOUS_TOL`` = 2**-16 ≈ 1.5e-5, i.e. 128 float32 ulps relative (or
  absolute for values below 1): 16× the measured spread, and still far below what any change of the
  maths moves them by (a dropped term, a different normalisation or clip bound: ≥ 1e-3).
- **noise** metrics measure the disagreement of two float32 paths that compute the same quantity
  (π_old vs the first training forward; trainer vs engine after a weight sync). Their value *is*
  rounding noise — 0.0 on one ISA, 2.4e-7 on another — so they are checked against a bound, not
  against the recorded noise: ``NOISE_BOUNDS``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.fixtures.method_golden import BACKENDS, CASES, run_case

GOLDEN = json.loads((Path(__file__).parent.parent / "fixtures" / "method_golden.json").read_text())

CONTINUOUS_TOL = 2.0**-16  # 128 float32 ulps (eps32 = 2**-23): see the module docstring

# Suffixes of metrics that count discrete events (or are exact functions of counts and the config).
COUNTED = (
    "/capability", "/n", "/roundtrip_mismatch", "/token_ratio", "/truncated_prompt", "/truncated_response",
    "/cross_clipfrac", "/neg", "/pos", "/cross_lower_bound", "/lr", "/num_cross", "/num_self",
    "/self_clipfrac", "/token_clipfrac", "/update", "/response_tokens_mean", "/reward_mean",
    "/rollout_tokens_total", "/sequences", "/truncated_frac", "verifier/errors", "verifier/timeouts",
)
COUNTED_PREFIXED = ("/omega/",)  # <agent>/omega/<source>: a ratio of two capabilities (reward means)

# Bounds of the noise metrics. onpolicy_ratio_dev = max |ratio − 1| of the first mini-batch, whose π_θ
# equals π_old exactly in real arithmetic: float32 log-prob sums of ≤ 16 tokens through two batch shapes,
# measured ≤ 4.8e-7; bound 2**-16 (128 ulps of 1). sync_logp_diff = |engine − trainer| Σ log-prob of the
# probe (sums up to ~ −130 nats, whose float32 ulp is 2**-17 ≈ 7.6e-6), measured ≤ 1 ulp; bound 2**-13
# (16 ulps). A broken weight sync moves it by ≥ 1e-2, and the run's own check refuses > 1e-3 per token.
NOISE_BOUNDS = {"/hacpo/onpolicy_ratio_dev": 2.0**-16, "/sync_logp_diff": 2.0**-13}


def metric_kind(key: str) -> str:
    """'noise', 'counted' or 'continuous' for a metric name (see the module docstring)."""
    if any(key.endswith(suffix) for suffix in NOISE_BOUNDS):
        return "noise"
    if key.endswith(COUNTED) or any(part in key for part in COUNTED_PREFIXED):
        return "counted"
    return "continuous"


def metric_mismatch(key: str, got: float, want: float) -> str | None:
    """Why ``got`` does not reproduce the recorded ``want`` for metric ``key``, or None when it does."""
    kind = metric_kind(key)
    if not (math.isfinite(got) and math.isfinite(want)):
        return None if got == want or (math.isnan(got) and math.isnan(want)) else f"{got!r} != {want!r}"
    if kind == "noise":
        bound = next(b for suffix, b in NOISE_BOUNDS.items() if key.endswith(suffix))
        return None if abs(got) <= bound and abs(want) <= bound else f"{got:.3g} (recorded {want:.3g}) > bound {bound:.3g}"
    if kind == "counted":
        return None if got == want else f"{got!r} != {want!r} (a counted metric must be equal)"
    if abs(got - want) <= CONTINUOUS_TOL * max(1.0, abs(want)):
        return None
    return f"{got!r} vs {want!r}: off by {abs(got - want):.3g} > {CONTINUOUS_TOL:.3g}·max(1, |recorded|)"


def test_golden_covers_every_case():
    assert sorted(GOLDEN) == sorted(f"{case}/{backend}" for case in CASES for backend in BACKENDS)


def test_every_recorded_counted_metric_is_a_count():
    """The 'counted' class holds only what is exact: its recorded values are ratios of counts over
    ≤ 1024 items or short decimals from the config (lr 0.001, a clip bound 0.9997), so a continuous
    metric (a float32 result such as 0.6427880264818668) misfiled as counted would show here."""
    for name, steps in GOLDEN.items():
        for metrics in steps:
            for key, value in metrics.items():
                if metric_kind(key) == "counted":
                    ratio_of_counts = any(abs(value * d - round(value * d)) < 1e-9 for d in range(1, 1025))
                    assert ratio_of_counts or abs(value - round(value, 6)) < 1e-12, (name, key, value)


@pytest.mark.parametrize(
    "key, got, want, ok",
    [
        ("llama/hacpo/loss", 0.6427886225283146, 0.6427880264818668, True),  # measured AVX2 vs recorded
        ("llama/hacpo/loss", 0.6427880264818668 * (1 + 1e-3), 0.6427880264818668, False),  # a real change
        ("llama/hacpo/cross_center/qwen3", 1e-5, 0.0, True),
        ("llama/hacpo/cross_center/qwen3", 1e-3, 0.0, False),
        ("llama/hacpo/onpolicy_ratio_dev", 4.768370445162873e-07, 0.0, True),  # measured AVX2 vs AVX-512
        ("llama/hacpo/onpolicy_ratio_dev", 1e-3, 0.0, False),  # π_θ ≠ π_old at the first mini-batch
        ("qwen3/sync_logp_diff", 7.62939453125e-06, 0.0, True),
        ("qwen3/sync_logp_diff", 1e-2, 0.0, False),  # a broken sync
        ("llama/rollout_tokens_total", 124.0, 124.0, True),
        ("llama/rollout_tokens_total", 125.0, 124.0, False),
        ("qwen3/omega/llama", 0.6428571428571429, 0.6428571428571429, True),
        ("llama/hacpo/cross_clipfrac/qwen3/pos", 0.5, 0.4375, False),
    ],
)
def test_comparison_accepts_rounding_and_rejects_real_changes(key, got, want, ok):
    assert (metric_mismatch(key, got, want) is None) == ok


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_method_metrics_equal_the_recorded_ones(tmp_path, case, backend):
    want = GOLDEN[f"{case}/{backend}"]
    got = run_case(tmp_path, case, backend)
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), f"step {step}: metric keys differ: {sorted(set(g) ^ set(w))}"
        problems = {key: why for key in w if (why := metric_mismatch(key, g[key], w[key])) is not None}
        assert not problems, f"{case}/{backend} step {step}: " + "; ".join(f"{k}: {v}" for k, v in problems.items())
