"""The data layouts a ``custom`` dataset may have besides our own, and which split a dataset task trains on.

A ``custom`` row (``data.task: custom``, ``data.path: my.parquet``; JSON lines or parquet) is read as:

- **verl's layout**, detected by its columns: ``prompt`` a chat list (``[{"role": "user", "content": ...}]``;
  the question is the last user message's content, a system message is left to each agent's prompt
  template), ``reward_model.ground_truth`` the reference answer, ``data_source`` handed to a verl-style
  checker (and kept as the record's ``source``), ``extra_info`` likewise (its ``index`` becomes the id
  when the row has no ``id``);
- **named columns**: ``data.prompt_key`` / ``data.answer_key`` name the question and answer columns of any
  other layout (a dotted key reaches into a mapping: ``reward_model.ground_truth``; a chat list is read
  as above);
- **our own**: ``question`` (or ``problem``, ``prompt``), ``answer``, optional ``id`` and ``solution``.

Which split a dataset task trains on: :mod:`.splits`.
"""

from __future__ import annotations

import json
from typing import Any

Columns = tuple[str | None, str | None]  # (data.prompt_key, data.answer_key)


def is_verl_row(row: dict) -> bool:
    """A verl-layout row: ``reward_model`` a mapping with ``ground_truth``, or ``prompt`` a chat list."""
    reward_model = row.get("reward_model")
    return (isinstance(reward_model, dict) and "ground_truth" in reward_model) or _is_chat(row.get("prompt"))


def _is_chat(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(m, dict) and "content" in m for m in value)


def chat_question(messages: list[dict]) -> str:
    """The question of a chat list: the last user message's content (every content when no role says user)."""
    users = [m for m in messages if m.get("role") == "user"]
    if users:
        return str(users[-1]["content"])
    return "\n\n".join(str(m["content"]) for m in messages)


def _get(row: dict, key: str) -> Any:
    """``row[key]``, a dotted key reaching into mappings (``reward_model.ground_truth``); KeyError naming it."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            raise KeyError(key)
        value = value[part]
    return value


def column_row(row: dict, columns: Columns) -> dict:
    """``row`` rewritten into our own layout (question, answer, id, solution) from verl's layout or the
    named columns; a row of our own layout is returned as it is. KeyError naming a missing column."""
    prompt_key, answer_key = columns
    if prompt_key is None and answer_key is None and not is_verl_row(row):
        return row
    verl = is_verl_row(row)
    out = {"id": row.get("id"), "solution": row.get("solution")}
    question = _get(row, prompt_key or ("prompt" if verl else "question"))
    out["question"] = chat_question(question) if _is_chat(question) else question
    out["answer"] = _get(row, answer_key or ("reward_model.ground_truth" if verl else "answer"))
    extra = row.get("extra_info")
    if out["id"] is None and isinstance(extra, dict) and extra.get("index") is not None:
        out["id"] = extra["index"]
    return out


def record_origin(row: dict, default: str) -> tuple[str, str]:
    """(source, extra) of a custom record: a verl row's ``data_source`` and ``extra_info`` as JSON text,
    else (``default``, "")."""
    if not is_verl_row(row):
        return default, ""
    source = row.get("data_source")
    extra = row.get("extra_info")
    return (str(source) if source not in (None, "") else default,
            json.dumps(extra, default=str) if extra is not None else "")


def dataset_options(data: Any) -> dict[str, Any]:
    """:func:`~hacrl_megatron.data.tasks.make_task`'s dataset options from a ``DataConfig``."""
    return {"columns": (data.prompt_key, data.answer_key), "allow_test_split": data.allow_test_split}
