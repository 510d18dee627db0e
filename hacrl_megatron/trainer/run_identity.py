"""What the separate jobs of one run must agree on, as a digest every exchange record carries.

Two jobs of one run (``hacrl train --agent NAME``, docs/exchange.md) must sample the same prompts,
score them with the same reward and learn with the same algorithm, or one agent trains on another's
answers to other questions. :func:`shared_config_fields` lists every setting that decides a prompt's
text, its reference answer or its reward — and the algorithm and sampling settings — each as a short
digest of its value; files enter by the sha256 of their **content** (the training data files, the
checker's source file), never by their path, since each job may read its own copy on its own host.
Where each job runs, writes or logs is left out.

A record whose digest differs is refused by :func:`mismatch`, which names the first setting whose
digest differs (the record carries the per-setting digests, never the values).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hacrl_megatron.config import ExperimentConfig

FIELD_DIGEST_CHARS = 16  # hex characters per setting: 64 bits, enough to tell two values apart
_HASH_CHUNK = 1 << 20


def _short(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:FIELD_DIGEST_CHARS]


def file_sha256(path: Path) -> str:
    """Hex sha256 of ``path``'s bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checker_identity(spec: str | None) -> dict[str, str] | None:
    """``data.checker`` as the function's name and the sha256 of the source file that defines it (a
    ``file.py:function`` spec, or the file a ``package.module:function`` spec imports); None without
    one. Two jobs whose checkers differ in content, wherever each file lives, differ here."""
    if spec is None:
        return None
    from hacrl_megatron.reward.custom import parse_checker_spec

    parsed = parse_checker_spec(spec)
    if parsed.is_file:
        source = Path(parsed.target).expanduser()
    else:
        found = importlib.util.find_spec(parsed.target)
        source = Path(found.origin) if found is not None and found.origin not in (None, "built-in", "frozen") else None
    content = file_sha256(source) if source is not None and source.is_file() else f"module {parsed.target}"
    return {"function": parsed.function, "source_sha256": content}


def data_files_identity(exp: ExperimentConfig) -> list[str]:
    """sha256 of each training data file's content, in reading order ([] for a procedural task)."""
    from hacrl_megatron.data import BENCHMARKS

    if exp.data.task not in BENCHMARKS:
        return []
    from hacrl_megatron.data.splits import training_split

    return [file_sha256(path) for path in training_split(exp.data.task, exp.data.path, exp.data.allow_test_split)[1]]


def shared_config_fields(exp: ExperimentConfig) -> dict[str, str]:
    """Setting name → :data:`FIELD_DIGEST_CHARS` hex digest of its value, for every setting the jobs of
    one run must share: the agents (names, order), the algorithm (each ``hacpo.*``), what a step samples
    (``train.seed``, ``prompts_per_step``, ``rollout_mode``, ``max_staleness``; the sampling settings and
    the exchange's eos rule), and what decides a prompt, its reference and its reward (``data.task``,
    ``difficulty``, ``seed``, ``prompt_key``, ``answer_key``, ``allow_test_split``, ``reward_range``,
    ``train.verifier_mode``, the checker's function and source content, the data files' content)."""
    r, t, d = exp.rollout, exp.train, exp.data
    values: dict[str, Any] = {"agents": [a.name for a in exp.agents]}
    values.update({f"hacpo.{k}": v for k, v in dataclasses.asdict(exp.hacpo).items()})
    values.update({f"train.{k}": getattr(t, k) for k in ("seed", "prompts_per_step", "rollout_mode", "max_staleness",
                                                         "verifier_mode")})
    values.update({f"rollout.{k}": getattr(r, k) for k in ("samples_per_prompt", "temperature", "top_p",
                                                           "max_prompt_len", "max_response_len", "eos_mode")})
    values.update({f"data.{k}": getattr(d, k) for k in ("task", "difficulty", "seed", "prompt_key", "answer_key",
                                                        "allow_test_split", "reward_range")})
    values["data.checker"] = checker_identity(d.checker)
    values["data.path (file content)"] = data_files_identity(exp)
    return {name: _short(value) for name, value in sorted(values.items())}


def digest_of(fields: Mapping[str, str]) -> str:
    """``sha256:<hex>`` over the sorted per-setting digests."""
    return "sha256:" + hashlib.sha256(json.dumps(dict(fields), sort_keys=True).encode()).hexdigest()


def shared_config_digest(exp: ExperimentConfig) -> str:
    """The digest of :func:`shared_config_fields` that every exchange record of this job carries."""
    return digest_of(shared_config_fields(exp))


def mismatch(own: Mapping[str, str], theirs: Mapping[str, str]) -> str:
    """The first setting (in name order) on which a peer's ``theirs`` differs from this job's ``own``, or
    a setting only one side has; "" when they agree."""
    for name in sorted(set(own) | set(theirs)):
        if own.get(name) != theirs.get(name):
            return name
    return ""
