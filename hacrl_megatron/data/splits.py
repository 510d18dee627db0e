"""Which split a dataset task trains on (``data.task`` a dataset, ``data.allow_test_split``).

A dataset task trains on its ``train`` split. A file that is a test split (``test.jsonl``,
``test-00000-of-00001.parquet``, a file in a ``test`` folder) or a test-only set (math500, aime2025, amc23,
minerva, olympiadbench) is refused naming the key unless ``data.allow_test_split=true``: evaluation
numbers on a split the agents trained on mean nothing (evaluate on them with ``data.eval_benchmarks``).
"""

from __future__ import annotations

from pathlib import Path

from hacrl_megatron.data.benchmarks import DataFileError, resolve_data_files

TRAIN_SPLIT = "train"
HAS_TRAIN_SPLIT = ("math", "gsm8k", "custom")  # the others are test sets only (hacrl prepare data writes no train)


def _is_test_file(path: Path) -> bool:
    """Whether ``path`` is a test split by its name: test.jsonl, test-*.parquet, or inside a test folder."""
    stem = path.name.split(".")[0]
    return stem == "test" or stem.startswith("test-") or path.parent.name == "test"


def training_split(name: str, path: str | None, allow_test_split: bool) -> tuple[str, list[Path]]:
    """(split, files) a dataset task trains on: its ``train`` split; with ``allow_test_split`` the test
    split too (the only one of math500, aime2025, amc23, minerva, olympiadbench). Raises
    :class:`DataFileError` naming the key for a test split not allowed, FileNotFoundError when nothing
    is found."""
    if name not in HAS_TRAIN_SPLIT:
        if not allow_test_split:
            raise DataFileError(
                f"data.task={name!r}: {name} is a test set (no train split): train on math, gsm8k or a custom file "
                f"and evaluate on {name} with data.eval_benchmarks, or set data.allow_test_split=true to train on it")
        return "test", resolve_data_files(name, path, "test")
    try:
        split, files = TRAIN_SPLIT, resolve_data_files(name, path, TRAIN_SPLIT)
    except FileNotFoundError:
        if not allow_test_split:
            raise
        split, files = "test", resolve_data_files(name, path, "test")
    tests = [f for f in files if _is_test_file(f)]
    if tests and not allow_test_split:
        raise DataFileError(
            f"data.path={path!r}: {tests[0]} is a test split; a dataset task trains on its train split (evaluation "
            f"on data the agents trained on means nothing): point data.path at the train split, or set "
            "data.allow_test_split=true to train on it anyway")
    return split, files
