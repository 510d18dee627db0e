"""``hacrl prepare data NAME...``: the paper's datasets from the hub into ``<out>/<name>/<split>.jsonl``.

Each dataset is read with ``datasets.load_dataset(<repo or mirror folder>, <config>, split=...)`` and
written as JSON lines with its original columns (plus an ``id`` where the release has none and the
loader wants one), which is exactly what :mod:`hacrl_megatron.data.benchmarks` reads; every file is
then loaded back through that reader, so a schema change upstream fails here with the file and
column named, not at training time.

| name | hub dataset (config) | splits written |
|---|---|---|
| math | DigitalLearningGmbH/MATH-lighteval (default) | train (7,500), test (5,000) |
| math500 | HuggingFaceH4/MATH-500 | test (500) |
| gsm8k | openai/gsm8k (main) | train (7,473), test (1,319) |
| aime2025 | opencompass/AIME2025 (AIME2025-I, AIME2025-II) | test (30; ids I-1..II-15) |
| amc23 | math-ai/amc23 | test (40) |
| minerva | math-ai/minervamath | test (272) |
| olympiadbench | math-ai/olympiadbench | test (675) |
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hacrl_megatron.data.benchmarks import load_benchmark_rows
from hacrl_megatron.durable import write_durably
from hacrl_megatron.prepare.hub import HubError, check_hub, mirror_repo, one_line

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    """One (config, split) of a hub dataset and the split file it becomes; ``id_prefix`` numbers
    rows ``<prefix>-1, -2, ...`` for releases without an id column."""

    config: str | None
    split: str
    out_split: str
    id_prefix: str | None = None


@dataclass(frozen=True)
class DatasetSource:
    """A hub dataset repository and the parts of it that make our splits."""

    repo: str
    parts: tuple[Part, ...]


DATASETS: dict[str, DatasetSource] = {
    "math": DatasetSource("DigitalLearningGmbH/MATH-lighteval",
                          (Part("default", "train", "train"), Part("default", "test", "test"))),
    "math500": DatasetSource("HuggingFaceH4/MATH-500", (Part(None, "test", "test"),)),
    "gsm8k": DatasetSource("openai/gsm8k", (Part("main", "train", "train"), Part("main", "test", "test"))),
    "aime2025": DatasetSource("opencompass/AIME2025", (Part("AIME2025-I", "test", "test", "I"),
                                                       Part("AIME2025-II", "test", "test", "II"))),
    "amc23": DatasetSource("math-ai/amc23", (Part(None, "test", "test"),)),
    "minerva": DatasetSource("math-ai/minervamath", (Part(None, "test", "test"),)),
    "olympiadbench": DatasetSource("math-ai/olympiadbench", (Part(None, "test", "test"),)),
}


def _load_part(source: str, part: Part) -> list[dict[str, Any]]:
    """Rows of one part via ``datasets`` (a hub id or a local folder in the hub's layout)."""
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("hacrl prepare data needs `datasets`: pip install 'hacrl_megatron[data]'") from exc
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(source, name=part.config, split=part.split)
    except Exception as err:  # datasets/huggingface_hub/requests raise many types; each is one line here
        where = f"{source}" + (f" (config {part.config})" if part.config else "") + f", split {part.split}"
        raise HubError(f"reading {where} failed: {one_line(err)}") from None
    rows = [dict(row) for row in table]
    if part.id_prefix is not None:
        for i, row in enumerate(rows, start=1):
            row.setdefault("id", f"{part.id_prefix}-{i}")
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    # atomic: an interrupted prepare never leaves half a split
    write_durably(path, "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows))


def prepare_dataset(name: str, out: str | os.PathLike, mirror: str | os.PathLike | None = None) -> dict[str, int]:
    """Write dataset ``name`` to ``<out>/<name>/<split>.jsonl``; returns split → records the loader reads.

    ``mirror``: read ``<mirror>/<repo id>`` (a copy of the hub repository) instead of the hub.
    Raises :class:`HubError` (one line) when the hub or the mirror folder cannot be read, and
    :class:`~hacrl_megatron.data.benchmarks.DataFileError` when a written split does not load.
    """
    if name not in DATASETS:
        raise HubError(f"unknown dataset {name!r}; hacrl prepare data knows: {', '.join(DATASETS)}")
    spec = DATASETS[name]
    if mirror is None:
        check_hub()
    source = spec.repo if mirror is None else str(mirror_repo(mirror, spec.repo))
    by_split: dict[str, list[dict[str, Any]]] = {}
    for part in spec.parts:
        by_split.setdefault(part.out_split, []).extend(_load_part(source, part))
    folder = Path(out).expanduser() / name
    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, rows in by_split.items():
        path = folder / f"{split}.jsonl"
        _write_jsonl(path, rows)
        counts[split] = len(load_benchmark_rows(name, str(path), split=split))  # our loader reads it back
        logger.info("%s: %s split, %d rows → %s (%d usable records)", name, split, len(rows), path, counts[split])
    return counts
