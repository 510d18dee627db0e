"""Local loaders for the paper's datasets (docs/algorithm.md §9), normalised to :class:`PromptRecord`.

Nothing downloads: each dataset is read from a local file: JSON lines (``.jsonl``, or ``.json``
holding one object per line or one list of objects) with the standard library, parquet with
``pyarrow`` (imported lazily). A malformed line, an empty file or a row without a needed column
raises :class:`DataFileError` naming the file and line; rows without a question or a reference
answer are skipped, counted and reported with their lines. Where the file is found:

1. ``path`` (``data.path`` in the config): a file, or a directory searched like step 2;
2. else ``$HACRL_DATA_DIR/<name>/``: ``<split>.jsonl``, ``<split>.json``, ``<split>.parquet``,
   ``<split>-*.parquet`` or ``data/<split>-*.parquet`` (the HF hub layout), or the only data file there.

Schemas (the columns of the public releases; all records get ``kind="math"``; ids are
``<name>-<dataset id>``, or ``<name>-<split>-<row>`` where the dataset has none):

| name | default split | question | reference answer | id |
|---|---|---|---|---|
| math | train | problem | last ``\\boxed{}`` of solution (+ level, type) | ``math-<split>-<row>`` |
| math500 | test | problem | answer (solution, subject, level also present) | unique_id |
| gsm8k | test | question | the number after ``####`` in answer | ``gsm8k-<split>-<row>`` |
| aime2025 | test | problem (or question) | answer | id (or ID) |
| amc23 | test | question (or problem) | answer (27.0 → 27) | id |
| minerva | test | problem (or question) | answer, else last ``\\boxed{}`` of solution | idx/id |
| olympiadbench | test | question (context prepended) | final_answer list, ``$`` stripped, joined by ", " | id |
| custom | train | question (or problem, prompt) | answer (any JSON value, as text) | id |

``custom`` is a user's own dataset (``data.task: custom``, ``data.path: my.jsonl``); its rows may carry
a ``solution`` (the warm-up's target; end it with ``\\boxed{answer}``), and ``data.checker`` can replace
the built-in verifier for it (``reward/custom.py``, ``examples/custom_task``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hacrl_megatron.data.formats import Columns, column_row, record_origin
from hacrl_megatron.data.records import PromptRecord
from hacrl_megatron.errors import InputError
from hacrl_megatron.reward.extract import last_boxed_answer

logger = logging.getLogger(__name__)

DATA_DIR_ENV = "HACRL_DATA_DIR"
DEFAULT_SPLITS = {
    "math": "train",
    "math500": "test",
    "gsm8k": "test",
    "aime2025": "test",
    "amc23": "test",
    "minerva": "test",
    "olympiadbench": "test",
    "custom": "train",
}
BENCHMARKS = tuple(DEFAULT_SPLITS)
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet")

# A row normaliser returns (question, answer, id or None, solution or None); None answer = skip row.
Row = tuple[str, str | None, str | None, str | None]
MAX_REPORTED_ROWS = 5  # skipped rows named in the warning
_QUESTION_COLUMNS = ("question", "problem", "prompt")  # a custom dataset's question, first present


class DataFileError(InputError):
    """A data file that is empty, malformed or lacks a column; the message names the file and line."""


class _BadValue(ValueError):
    """A row value of a type no record can hold (a mapping as the question, NaN as the answer)."""


def _answer_text(value: Any) -> str | None:
    """A reference answer as a string: ints as digits, integral floats without ``.0``, lists joined.

    Raises :class:`_BadValue` for a mapping or a non-finite number: stringified, it would be a
    reference no response can match ("nan", "{'k': 1}")."""
    if value is None:
        return None
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise _BadValue(f"the reference answer is {value} (not a finite number)")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, dict):
        raise _BadValue("the reference answer is a mapping (expected text, a number or a list of them)")
    if isinstance(value, (list, tuple)):
        parts = [p for p in (_answer_text(v) for v in value) if p]
        return ", ".join(parts) if parts else None
    text = str(value).strip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    return text or None


def _col(row: dict, *names: str) -> Any:
    """The first of ``names`` present in ``row`` (schemas differ between releases)."""
    for name in names:
        if name in row and row[name] is not None:
            return row[name]
    raise KeyError(" or ".join(names))


def _math_row(row: dict) -> Row:
    solution = _col(row, "solution")
    return _col(row, "problem"), last_boxed_answer(solution), None, solution


def _math500_row(row: dict) -> Row:
    return (
        _col(row, "problem"),
        _answer_text(_col(row, "answer")),
        str(_col(row, "unique_id")),
        row.get("solution"),
    )


def _gsm8k_row(row: dict) -> Row:
    full = _col(row, "answer")
    if "####" not in full:
        return _col(row, "question"), None, None, None
    reasoning, final = full.rsplit("####", 1)
    return _col(row, "question"), final.strip().replace(",", ""), None, reasoning.strip()


def _aime_row(row: dict) -> Row:
    rid = row.get("id", row.get("ID"))
    return _col(row, "problem", "question"), _answer_text(_col(row, "answer")), rid, row.get("solution")


def _amc_row(row: dict) -> Row:
    return _col(row, "question", "problem"), _answer_text(_col(row, "answer")), row.get("id"), None


def _minerva_row(row: dict) -> Row:
    solution = row.get("solution")
    answer = _answer_text(row.get("answer")) if row.get("answer") is not None else None
    if answer is None:
        answer = last_boxed_answer(_col(row, "solution"))
    return _col(row, "problem", "question"), answer, row.get("idx", row.get("id")), solution


def _olympiad_row(row: dict) -> Row:
    question = _col(row, "question")
    context = row.get("context")
    if isinstance(context, str) and context.strip():
        question = context.strip() + "\n\n" + question
    solution = row.get("solution")
    if isinstance(solution, list):
        solution = "\n\n".join(str(s) for s in solution) or None
    return question, _answer_text(_col(row, "final_answer")), row.get("id"), solution


def _custom_row(row: dict) -> Row:
    solution = row.get("solution")
    return _col(row, *_QUESTION_COLUMNS), _answer_text(_col(row, "answer")), row.get("id"), solution


_NORMALISERS: dict[str, Callable[[dict], Row]] = {
    "math": _math_row,
    "math500": _math500_row,
    "gsm8k": _gsm8k_row,
    "aime2025": _aime_row,
    "amc23": _amc_row,
    "minerva": _minerva_row,
    "olympiadbench": _olympiad_row,
    "custom": _custom_row,
}


def _candidates(directory: Path, split: str) -> list[Path]:
    names = [directory / f"{split}{suffix}" for suffix in _DATA_SUFFIXES]
    found = [p for p in names if p.is_file()]
    found += sorted(directory.glob(f"{split}-*.parquet")) + sorted(directory.glob(f"data/{split}-*.parquet"))
    if not found and directory.is_dir():
        data_files = [p for p in sorted(directory.iterdir()) if p.suffix in _DATA_SUFFIXES and p.is_file()]
        if len(data_files) == 1:
            found = data_files
    return found


def resolve_data_files(name: str, path: str | None = None, split: str | None = None) -> list[Path]:
    """The local file(s) holding benchmark ``name``; FileNotFoundError saying where to put them."""
    if name not in DEFAULT_SPLITS:
        raise ValueError(f"unknown benchmark {name!r}; valid names: {', '.join(BENCHMARKS)}")
    split = split or DEFAULT_SPLITS[name]
    if path is not None:
        p = Path(path).expanduser()
        if p.is_file():
            return [p]
        if p.suffix in _DATA_SUFFIXES and not p.exists():  # a file was meant: say so, not "no file in folder"
            raise FileNotFoundError(f"benchmark {name!r}: no such file {p}")
        directory = p
    elif os.environ.get(DATA_DIR_ENV):
        directory = Path(os.environ[DATA_DIR_ENV]).expanduser() / name
    else:
        raise FileNotFoundError(
            f"benchmark {name!r} needs a local file and none was given: pass data.path=<file or dir> "
            f"or set {DATA_DIR_ENV}=<dir> with <dir>/{name}/{split}.jsonl (or .json/.parquet, or the HF "
            f"layout data/{split}-*.parquet). Nothing is downloaded at run time."
        )
    found = _candidates(directory, split) if directory.is_dir() else []
    if not found:
        expected = ", ".join(str(directory / f"{split}{s}") for s in _DATA_SUFFIXES)
        raise FileNotFoundError(
            f"benchmark {name!r} (split {split!r}): no data file found; expected one of {expected} "
            f"or {directory}/data/{split}-*.parquet. Put the dataset's {split} split there "
            f"(data.path or {DATA_DIR_ENV}/<name>/). Nothing is downloaded at run time."
        )
    return found


def _json_value(text: str, path: Path, lineno: int | None = None, hint: str = "") -> Any:
    """``json.loads(text)`` of line ``lineno`` of ``path`` (None: the whole file); DataFileError naming the
    file and line for malformed JSON, an integer longer than Python converts (4,300 digits) or nesting
    deeper than Python's recursion."""
    where = f"{path}:{lineno}" if lineno is not None else str(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        line = where if lineno is not None else f"{path}:{err.lineno}"
        raise DataFileError(f"{line}: not valid JSON ({err.msg} at column {err.colno}){hint}") from None
    except ValueError as err:  # int('9' * 5000): Python refuses to convert more than 4300 digits
        raise DataFileError(f"{where}: a value cannot be read ({str(err).split(';')[0]}){hint}") from None
    except RecursionError:
        raise DataFileError(f"{where}: nested too deeply to read (arrays or objects inside each other){hint}") from None


def _json_rows(path: Path) -> list[tuple[dict, str]]:
    """(row, "file:line") of a JSON-lines file, or of a ``.json`` file holding one list of objects."""
    text = path.read_text(encoding="utf-8", errors="strict")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        items = _json_value(text, path)
        rows = [(item, f"{path} item {i}") for i, item in enumerate(items)]
    else:
        rows = []
        hint = "; each line must hold one JSON object: fix or delete that line"
        for lineno, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                rows.append((_json_value(line, path, lineno, hint), f"{path}:{lineno}"))
    for row, where in rows:
        if not isinstance(row, dict):
            raise DataFileError(f"{where}: expected a JSON object (one record), got {type(row).__name__}")
    return rows


def _parquet_rows(path: Path) -> list[tuple[dict, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("reading parquet benchmarks needs pyarrow: pip install pyarrow (or '.[data]')") from exc
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for a damaged file
        raise DataFileError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    return [(row, f"{path} row {i}") for i, row in enumerate(table.to_pylist())]


def _read_rows(files: list[Path]) -> list[tuple[dict, str]]:
    """Every row of ``files`` with where it came from ("file:line" or "file row i"), in order."""
    rows: list[tuple[dict, str]] = []
    for path in files:
        try:
            found = _parquet_rows(path) if path.suffix == ".parquet" else _json_rows(path)
        except UnicodeDecodeError as err:
            raise DataFileError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
        if not found:
            raise DataFileError(f"{path}: empty file (no records)")
        rows += found
    return rows


def _record(name: str, split: str, i: int, row: dict, where: str,
            columns: Columns = (None, None)) -> tuple[PromptRecord, str | None] | None:
    """Row ``i`` of dataset ``name`` as (record, solution); None for a row without a question or an
    answer. DataFileError naming ``where`` and the column for a missing column or a value of the
    wrong type (a list as the question, NaN as the answer, a mapping as the id). A custom row may be in
    verl's layout or name its columns (``columns``: data.prompt_key, data.answer_key; data/formats.py)."""
    try:
        question, answer, rid, solution = _NORMALISERS[name](column_row(row, columns) if name == "custom" else row)
    except KeyError as exc:
        raise DataFileError(f"{where}: {name} row has no value in column {exc.args[0]} (missing or null); "
                            f"its columns are {sorted(row)}") from None
    except _BadValue as err:
        column = "final_answer" if name == "olympiadbench" else "answer"
        if name == "custom" and columns[1] is not None:
            column = f"{columns[1]} (data.answer_key)"
        raise DataFileError(f"{where}: column {column}: {err}") from None
    except (TypeError, AttributeError) as err:  # e.g. a list where the normaliser joins or searches text
        raise DataFileError(f"{where}: {name} row holds a value of the wrong type ({err})") from None
    if not isinstance(question, str):
        column = next((c for c in _QUESTION_COLUMNS if row.get(c) is not None), "question")
        if name == "custom" and columns[0] is not None:  # the user named it: that is the column read
            column = f"{columns[0]} (data.prompt_key)"
        raise DataFileError(f"{where}: column {column}: the question must be text, got {type(question).__name__}")
    if solution is not None and not isinstance(solution, str):
        raise DataFileError(f"{where}: column solution: must be text, got {type(solution).__name__}")
    if isinstance(rid, float) and rid.is_integer():
        rid = int(rid)
    if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
        raise DataFileError(f"{where}: column id: must be text or an integer, got {type(rid).__name__}")
    if not answer or not question.strip():
        return None
    rec_id = f"{name}-{rid}" if rid not in (None, "") else f"{name}-{split}-{i}"
    source, extra = record_origin(row, name) if name == "custom" else (name, "")
    return PromptRecord(rec_id, question, answer, source, "math", extra), solution


def load_benchmark_rows(
    name: str, path: str | None = None, limit: int | None = None, split: str | None = None,
    columns: Columns = (None, None),
) -> list[tuple[PromptRecord, str | None]]:
    """Records with their reference solution text (None when the dataset has none); ``columns``: a
    custom dataset's (data.prompt_key, data.answer_key).

    Rows without a question or a reference answer are skipped and reported (a warning with their
    count and first lines); a file where every row is skipped raises :class:`DataFileError`.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit} must be >= 0 or None")
    split = split or DEFAULT_SPLITS.get(name, "")
    files = resolve_data_files(name, path, split)
    rows = _read_rows(files)
    out: list[tuple[PromptRecord, str | None]] = []
    skipped: list[str] = []
    first_use: dict[str, str] = {}  # id -> where it was first read
    for i, (row, where) in enumerate(rows):
        if limit is not None and len(out) >= limit:
            break
        item = _record(name, split, i, row, where, columns)
        if item is None:
            skipped.append(where)
            continue
        rec_id = item[0].id
        if rec_id in first_use:
            shown = rec_id.removeprefix(f"{name}-")  # as written in the file (or the row's own default)
            raise DataFileError(f"{where}: id {shown!r} is already used by {first_use[rec_id]}: ids must be unique "
                                "(the trainer finds each prompt and its solution by id); rename or remove one")
        first_use[rec_id] = where
        out.append(item)
    if skipped:
        shown = ", ".join(skipped[:MAX_REPORTED_ROWS]) + (", ..." if len(skipped) > MAX_REPORTED_ROWS else "")
        logger.warning("%s: skipped %d of %d rows without a question or a reference answer: %s",
                       name, len(skipped), len(skipped) + len(out), shown)
        if not out:
            raise DataFileError(f"{', '.join(map(str, files))}: all {len(skipped)} {name} rows lack a question "
                                f"or a reference answer (first: {skipped[0]})")
    return out


def load_benchmark(
    name: str, path: str | None = None, limit: int | None = None, split: str | None = None
) -> list[PromptRecord]:
    """Benchmark ``name`` (one of ``BENCHMARKS``) as PromptRecords, at most ``limit`` of them.

    ``path``: a data file or directory (else ``$HACRL_DATA_DIR/<name>/``); ``split``: which split's
    file to look for (default per dataset, ``DEFAULT_SPLITS``).
    """
    return [rec for rec, _ in load_benchmark_rows(name, path, limit, split)]
