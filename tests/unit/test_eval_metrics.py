"""Estimators: pass@k against the binomial formula and brute force; avg and best definitions."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hacrl_megatron.eval import pass_at_k, problem_metrics


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_equals_binomial_formula(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_brute_force_over_subsets():
    samples = [1, 0, 0, 1, 0, 0]  # n = 6, c = 2
    for k in range(1, 7):
        subsets = list(itertools.combinations(samples, k))
        expected = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(6, 2, k) == pytest.approx(expected)


def test_pass_at_k_edges_and_errors():
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0 and pass_at_k(5, 3, 3) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="n >= k >= 1"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="c=4"):
        pass_at_k(3, 4, 1)


def test_problem_metrics_definitions():
    correct = [[1, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1]]
    m = problem_metrics(correct, k=2)
    assert m["avg"] == pytest.approx((1 + 0.5 + 0 + 0.25) / 4)
    assert m["pass_at_k"] == pytest.approx((1 + 5 / 6 + 0 + 0.5) / 4)
    assert m["best_at_k"] == pytest.approx(2 / 4)  # any of the *first* k=2 samples: problems 0 and 1
    assert problem_metrics(correct, k=4)["best_at_k"] == problem_metrics(correct, k=4)["pass_at_k"] == 0.75
    with pytest.raises(ValueError, match="same number of samples"):
        problem_metrics([[1], [1, 0]], k=1)
    with pytest.raises(ValueError, match="< k=3"):
        problem_metrics([[1, 0]], k=3)
