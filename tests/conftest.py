"""Test-wide settings.

One intra-op thread per test process: on the 2-core CI machine a test that spawns workers (gloo
ranks, verifier processes) would otherwise run 2 threads per process and oversubscribe the cores;
OpenMP spin-waiting then makes tiny models 10-30× slower (measured: 38 s vs 1.2 s per step).
"""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


# Equality-sensitive tests: goldens, kernels against their reference, converters, resumed-vs-unbroken
# and backend-parity runs. Their float comparisons are the ones another CPU's vector kernels (default,
# AVX2, AVX-512: another summation order, other last bits) can break, so CI runs them a second time
# under ATEN_CPU_CAPABILITY=default besides the machine's own (`pytest -m numerics`). A glob that
# matches no file fails tests/unit/test_numerics_marker.py, so a rename cannot drop a module silently.
NUMERICS_MODULES = (
    "e2e/test_method_golden.py", "e2e/test_trainer.py", "e2e/test_trainer_parity.py",
    "e2e/test_trainer_variants.py", "e2e/test_rollout_modes.py",
    "unit/test_kernels_*.py", "unit/test_algo_*.py", "unit/test_models_convert*.py",
    "unit/test_models_provider.py", "unit/test_models_cpu_compat.py", "unit/test_agent_local.py",
    "unit/test_agent_hf.py", "unit/test_sync_transports.py", "unit/test_rollout_hf.py", "unit/test_exchange_*.py",
    "distributed/test_kernels_tp*.py", "distributed/test_weight_sync_world.py",
)


def is_numerics(relative_path: str) -> bool:
    """Whether a test file (path relative to tests/) is equality-sensitive: NUMERICS_MODULES."""
    import fnmatch

    return any(fnmatch.fnmatch(relative_path, pattern) for pattern in NUMERICS_MODULES)


def pytest_collection_modifyitems(config, items):
    import pytest

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if is_numerics(os.path.relpath(str(item.path), tests_dir)):
            item.add_marker(pytest.mark.numerics)
