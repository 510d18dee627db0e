"""The benchmarks a training run evaluates on (``data.eval_benchmarks``), found and loaded.

A name is either a dataset of :data:`~hacrl_megatron.data.benchmarks.BENCHMARKS` (its evaluation
split, :data:`EVAL_SPLITS`: the test split, the only one most releases have) or a procedural task
of :data:`~hacrl_megatron.data.procedural.TASKS` (its held-out set at ``data.difficulty`` and
``data.seed``, never sampled for training). A dataset's file is looked up in this order:

1. ``data.benchmark_paths.<name>``: a file, or a folder holding ``<split>.jsonl`` (or ``.json``,
   ``.parquet``, the hub layout ``data/<split>-*.parquet``);
2. ``$HACRL_DATA_DIR/<name>/``;
3. ``data/<name>/`` under the working directory: where ``hacrl prepare data NAME`` writes.

Nothing downloads. :func:`benchmark_problem` says what is wrong with a name (for the config
checks), :func:`load_eval_benchmarks` loads them all (``data.eval_limit`` problems each at most).
"""

from __future__ import annotations

import os
from pathlib import Path

from hacrl_megatron.data.benchmarks import BENCHMARKS, DATA_DIR_ENV, load_benchmark, resolve_data_files
from hacrl_megatron.data.procedural import TASKS
from hacrl_megatron.data.records import PromptRecord

EVAL_SPLITS = {name: ("train" if name == "custom" else "test") for name in BENCHMARKS}
PREPARED_DIR = "data"  # `hacrl prepare data`'s default --out
PROCEDURAL_EVAL_SIZE = 200  # problems of a procedural benchmark when data.eval_limit is 0


def benchmark_path(name: str, paths: dict[str, str]) -> str | None:
    """Where dataset ``name`` is read from: its ``paths`` entry, else None when ``$HACRL_DATA_DIR`` is
    set (the loader looks there), else ``data/<name>`` (``hacrl prepare data``'s folder)."""
    if name in paths:
        return paths[name]
    if os.environ.get(DATA_DIR_ENV):
        return None
    return str(Path(PREPARED_DIR) / name)


def benchmark_problem(name: str, paths: dict[str, str]) -> str | None:
    """Why ``name`` cannot be evaluated here (unknown, or its file missing), or None when it can."""
    if name in TASKS:
        return None
    if name not in BENCHMARKS:
        return (f"{name!r} is not a benchmark: datasets {list(BENCHMARKS)}, procedural tasks {list(TASKS)}")
    path, split = benchmark_path(name, paths), EVAL_SPLITS[name]
    try:
        resolve_data_files(name, path, split)
    except FileNotFoundError:
        folder = Path(path) if path is not None else Path(os.environ[DATA_DIR_ENV]) / name
        where = ("no such file or folder" if not folder.exists() else
                 f"no {split}.jsonl, {split}.json, {split}.parquet or data/{split}-*.parquet in it")
        return (f"benchmark {name!r} reads {folder} ({where}); set data.benchmark_paths.{name}=<file or folder>, "
                f"or run `hacrl prepare data {name}` (it writes {PREPARED_DIR}/{name}/{split}.jsonl)")
    return None


def load_eval_benchmarks(names: list[str], paths: dict[str, str], limit: int, difficulty: int,
                         seed: int) -> dict[str, list[PromptRecord]]:
    """Benchmark name → its problems, in ``names`` order (see the module for where each comes from).

    ``limit``: the first ``limit`` problems of each (0: a dataset's all, :data:`PROCEDURAL_EVAL_SIZE`
    of a procedural task); ``difficulty`` and ``seed``: the procedural tasks' knob and seed.
    """
    from hacrl_megatron.data.tasks import make_task

    out: dict[str, list[PromptRecord]] = {}
    for name in names:
        if name in TASKS:
            out[name] = make_task(name, difficulty, seed).eval_set(limit or PROCEDURAL_EVAL_SIZE)
        else:
            out[name] = load_benchmark(name, benchmark_path(name, paths), limit or None, EVAL_SPLITS[name])
    return out
