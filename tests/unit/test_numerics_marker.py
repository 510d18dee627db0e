"""The `numerics` marker (tests/conftest.py) that CI re-runs under ATEN_CPU_CAPABILITY=default covers
real modules: every pattern matches a test file, and the golden test is among them."""

from pathlib import Path

from tests.conftest import NUMERICS_MODULES, is_numerics

TESTS = Path(__file__).resolve().parent.parent


def test_every_numerics_pattern_matches_a_test_module():
    for pattern in NUMERICS_MODULES:
        assert sorted(TESTS.glob(pattern)), f"NUMERICS_MODULES pattern {pattern!r} matches no file under tests/"


def test_the_equality_sensitive_modules_are_marked_and_others_not():
    assert is_numerics("e2e/test_method_golden.py")
    assert is_numerics("unit/test_kernels_reference.py") and is_numerics("distributed/test_kernels_tp.py")
    assert not is_numerics("unit/test_cli.py") and not is_numerics("faults/test_inputs.py")
