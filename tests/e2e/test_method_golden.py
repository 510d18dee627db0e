"""Every method and ablation trains as it did before the algorithm became one object (algo/algorithm.py).

tests/fixtures/method_golden.json holds 3 steps of per-step metrics (losses, ratios, clip fractions,
gradient norms, rewards, ω, sync checks) of each case of ``tests.fixtures.method_golden.CASES`` on
both backends, recorded with the trainer as it was before the refactor (there they were equal bit
for bit). Regenerate only when a change of the training maths is intended:
``python -m tests.fixtures.method_golden tests/fixtures/method_golden.json``.
"""

import json
from pathlib import Path

import pytest

from tests.fixtures.method_golden import BACKENDS, CASES, run_case

GOLDEN = json.loads((Path(__file__).parent.parent / "fixtures" / "method_golden.json").read_text())


def test_golden_covers_every_case():
    assert sorted(GOLDEN) == sorted(f"{case}/{backend}" for case in CASES for backend in BACKENDS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_method_metrics_equal_the_recorded_ones(tmp_path, case, backend):
    want = GOLDEN[f"{case}/{backend}"]
    got = run_case(tmp_path, case, backend)
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), f"step {step}: metric keys differ: {sorted(set(g) ^ set(w))}"
        for key in w:
            # the same machine reproduces these bit for bit; another CPU may round the last bits differently
            assert g[key] == pytest.approx(w[key], rel=1e-6, abs=1e-9), f"{case}/{backend} step {step}: {key}"
