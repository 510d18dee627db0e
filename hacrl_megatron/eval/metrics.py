"""Per-problem accuracy estimators: avg@n, pass@k (unbiased), best@k.

Definitions (c = correct samples among n drawn for one problem; a sample is correct when its
reward is > 0, the convention of docs/algorithm.md §1 — math rewards are binary):

- avg@n  = c / n, averaged over problems. With n = 1 greedy this is the paper's avg@1.
- pass@k = 1 − C(n − c, k) / C(n, k), averaged over problems: the unbiased estimator of "at
  least one of k fresh samples is correct" from n ≥ k samples (Chen et al. 2021, Codex paper).
- best@k = fraction of problems where at least one of the first k samples is correct — the
  empirical quantity the paper reports for AIME2025 (best@30 with n = k = 30). With n = k it
  equals pass@k.
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct out of ``n`` samples (requires n ≥ k ≥ 1).

    Computed as 1 − Π_{i=n−c+1}^{n} (1 − k/i), the numerically stable product form of
    1 − C(n−c, k)/C(n, k).
    """
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"pass_at_k: n, c, k must be integers, got {n!r}, {c!r}, {k!r}")
    if k < 1 or n < k:
        raise ValueError(f"pass_at_k: need n >= k >= 1, got n={n}, k={k}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} must lie in [0, n={n}]")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def problem_metrics(correct: Sequence[Sequence[bool]], k: int) -> dict[str, float]:
    """avg, pass_at_k, best_at_k over problems; ``correct[p][s]`` is sample s of problem p.

    Every problem must have the same number of samples n ≥ k.
    """
    if not correct:
        raise ValueError("problem_metrics: no problems")
    n = len(correct[0])
    if any(len(row) != n for row in correct):
        raise ValueError("problem_metrics: every problem needs the same number of samples")
    if n < k:
        raise ValueError(f"problem_metrics: {n} samples per problem < k={k}")
    counts = [sum(bool(x) for x in row) for row in correct]
    m = len(correct)
    return {
        "avg": sum(c / n for c in counts) / m,
        "pass_at_k": sum(pass_at_k(n, c, k) for c in counts) / m,
        "best_at_k": sum(any(row[:k]) for row in correct) / m,
    }
