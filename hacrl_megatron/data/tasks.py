"""Task registry: one interface over procedural generators and local datasets.

``make_task(name, difficulty, seed)`` returns an object with

- ``sample(n, offset=0) -> list[PromptRecord]``: training items ``offset .. offset+n-1``, a pure
  function of (seed, index), so a resumed run continues from its saved data position;
- ``eval_set(n) -> list[PromptRecord]``: held-out items, disjoint from training items;
- ``sft_target(record) -> str``: a correct response ending with ``\\boxed{answer}`` (warm-up SFT).

Procedural names: ``addition``, ``addition_cot``, ``arithmetic``, ``linear``, ``countdown``, ``add_sub_cot``
(:mod:`.procedural`; the last has problem families).
Dataset names (``data.benchmarks.BENCHMARKS``, e.g. ``math`` for the paper's MATH train split)
load a local file (``path`` or ``$HACRL_DATA_DIR``) and are wrapped in :class:`DatasetTask`.
"""

from __future__ import annotations

import random
from typing import Any, Protocol

from hacrl_megatron.data.benchmarks import BENCHMARKS, DataFileError, load_benchmark_rows
from hacrl_megatron.data.formats import Columns
from hacrl_megatron.data.procedural import TASKS, ProceduralTask
from hacrl_megatron.data.records import PromptRecord
from hacrl_megatron.data.splits import training_split
from hacrl_megatron.reward.extract import last_boxed_answer
from hacrl_megatron.reward.normalize import is_equiv


class Task(Protocol):
    """What the trainer and the evaluator need from a task."""

    name: str

    def sample(self, n: int, offset: int = 0) -> list[PromptRecord]: ...

    def eval_set(self, n: int) -> list[PromptRecord]: ...

    def sft_target(self, record: PromptRecord) -> str: ...


class DatasetTask:
    """A local dataset as a task: a held-out eval slice, and epochs of seeded shuffles for training.

    Args:
        name: dataset name (``source`` of its records).
        rows: (record, reference solution or None) pairs, e.g. from ``load_benchmark_rows``.
        seed: shuffling seed.
        eval_holdout: items reserved for ``eval_set`` (default: min(200, len // 10)); they are the
            first items of a seeded permutation and never appear in ``sample``.
    """

    def __init__(
        self,
        name: str,
        rows: list[tuple[PromptRecord, str | None]],
        seed: int,
        eval_holdout: int | None = None,
    ) -> None:
        if not rows:
            raise ValueError(f"dataset task {name!r} has no rows")
        holdout = min(200, len(rows) // 10) if eval_holdout is None else eval_holdout
        if not 0 <= holdout < len(rows):
            raise ValueError(f"eval_holdout={holdout} must be in [0, {len(rows) - 1}] for {len(rows)} rows")
        self.name = name
        self.seed = seed
        order = list(range(len(rows)))
        random.Random(f"hacrl/{name}/s{seed}/holdout").shuffle(order)
        self._eval = [rows[i][0] for i in order[:holdout]]
        self._train = [rows[i][0] for i in order[holdout:]]
        self._solutions = {rec.id: sol for rec, sol in rows}
        self._epochs: dict[int, list[int]] = {}

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._epochs:
            order = list(range(len(self._train)))
            random.Random(f"hacrl/{self.name}/s{self.seed}/epoch{epoch}").shuffle(order)
            self._epochs = {epoch: order}  # keep one epoch: memory stays O(dataset)
        return self._epochs[epoch]

    def sample(self, n: int, offset: int = 0) -> list[PromptRecord]:
        """Training items ``offset .. offset+n-1``; epoch e is a fresh seeded shuffle."""
        if n < 0 or offset < 0:
            raise ValueError(f"{self.name}.sample: n={n} and offset={offset} must be >= 0")
        size = len(self._train)
        return [self._train[self._epoch_order(i // size)[i % size]] for i in range(offset, offset + n)]

    @property
    def held_out(self) -> int:
        """How many records ``eval_set`` can return."""
        return len(self._eval)

    @property
    def size(self) -> int:
        """Every record: held out and training."""
        return len(self._eval) + len(self._train)

    def eval_set(self, n: int) -> list[PromptRecord]:
        """The first ``n`` held-out records (n ≤ eval_holdout)."""
        if not 0 <= n <= len(self._eval):
            raise ValueError(
                f"{self.name}.eval_set: n={n} exceeds the {len(self._eval)} held-out items; "
                "raise eval_holdout or evaluate on a separate benchmark (data.eval_benchmarks)"
            )
        return self._eval[:n]

    def sft_target(self, record: PromptRecord) -> str:
        """The reference solution when it ends in the right boxed answer, else a short boxed answer."""
        if record.id not in self._solutions:
            raise ValueError(f"record {record.id!r} is not part of dataset task {self.name!r}")
        solution = (self._solutions[record.id] or "").strip()
        boxed = "\\boxed{" + record.answer + "}"
        if not solution:
            return f"The final answer is {boxed}."
        if is_equiv(last_boxed_answer(solution), record.answer) and solution.rstrip(" .$").endswith("}"):
            return solution
        return f"{solution}\nThe final answer is {boxed}."


def make_task(
    name: str,
    difficulty: int = 2,
    seed: int = 1234,
    *,
    path: str | None = None,
    eval_holdout: int | None = None,
    columns: Columns = (None, None),
    allow_test_split: bool = False,
) -> ProceduralTask | DatasetTask:
    """The task called ``name``: procedural (``TASKS``) or a local dataset (``BENCHMARKS``).

    ``difficulty`` is the procedural knob (ignored for datasets); ``path``, ``eval_holdout``, ``columns``
    (a custom file's data.prompt_key, data.answer_key) and ``allow_test_split`` only apply to datasets,
    which train on their train split (data/formats.py). Unknown names raise ValueError listing the valid ones.
    """
    if name in TASKS:
        return TASKS[name](difficulty, seed)
    if name in BENCHMARKS:
        split, _ = training_split(name, path, allow_test_split)
        return DatasetTask(name, load_benchmark_rows(name, path, split=split, columns=columns), seed, eval_holdout)
    raise ValueError(
        f"unknown task {name!r}; procedural tasks: {', '.join(TASKS)}; datasets: {', '.join(BENCHMARKS)}"
    )


def task_and_eval_set(
    name: str, difficulty: int, seed: int, path: str | None, eval_size: int, **options: Any
) -> tuple[ProceduralTask | DatasetTask, list[PromptRecord]]:
    """The task of ``data.*`` and its first ``eval_size`` held-out prompts (0 when the run does not
    evaluate), read the same way by ``hacrl config`` and at training start-up.

    A dataset holding fewer held-out rows than ``eval_size`` raises :class:`DataFileError` naming
    ``data.eval_size``, the dataset's size and how to proceed (a smaller size, or no evaluation).
    ``options``: :func:`make_task`'s dataset options (``data.formats.dataset_options``).
    """
    task = make_task(name, difficulty, seed, path=path, **options)
    if isinstance(task, DatasetTask) and eval_size > task.held_out:
        raise DataFileError(f"data.eval_size={eval_size}: dataset {name!r} ({path}) has {task.size} usable rows, "
                            f"{task.held_out} of them held out for evaluation (a tenth, at most 200): set "
                            f"data.eval_size <= {task.held_out}, or train.eval_every=0 to train without evaluation")
    return task, task.eval_set(eval_size)
