"""Building an :class:`ExperimentConfig` from YAML presets (with ``base:`` chains) and dotted overrides."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
import warnings
from pathlib import Path
from typing import Any

import yaml

from hacrl_megatron.config.bounded_yaml import (
    MAX_BASE_CHAIN,
    MAX_DEPTH,
    load_bounded,
    read_preset_text,
    short_repr,
)
from hacrl_megatron.config.schema import PRESET_DIR, ConfigError, ExperimentConfig
from hacrl_megatron.config.validation import validate

FLOAT_LITERAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _yaml_problem(err: yaml.YAMLError) -> str:
    """Where and why PyYAML stopped: ``line L, column C: <problem> (<context>)``, 1-based."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err)
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and start is not None and mark is not None and start.line != mark.line:
        context += f" started at line {start.line + 1}, column {start.column + 1}"
    return where + problem + (f" ({context})" if context else "")


# --------------------------------------------------------------------------------------------
# building from plain data


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert ``value`` to the annotated type ``tp`` or raise ConfigError naming ``path``."""
    tp, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{path}: value None is not allowed (expected {getattr(tp, '__name__', tp)})")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {short_repr(value)}")
        return from_dict(tp, value, path)
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {short_repr(value)}")
        return [_coerce(v, item_tp, f"{path}.{i}") for i, v in enumerate(value)]
    if origin is dict:  # a name → value map (data.benchmark_paths): string keys, typed values
        key_tp, item_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping (name: value), got a {type(value).__name__}")
        return {_coerce(k, key_tp, path): _coerce(v, item_tp, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true/false, got {short_repr(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {short_repr(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads 1e-3 (no dot) as a string; a plain decimal or exponent literal is still a number
        if isinstance(value, str) and FLOAT_LITERAL.fullmatch(value.strip()):
            return float(value)
        raise ConfigError(f"{path}: expected a number, got {short_repr(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {short_repr(value)}")
    return value


def resolve_key_aliases(cls: type, data: dict[str, Any], path: str = "") -> dict[str, Any]:
    """``data`` with the old keys of ``cls`` (its ``KEY_ALIASES``: old key → dotted new key, e.g.
    ``sglang_tp`` → ``sglang.tp``) moved to their new place, each with a FutureWarning naming both.

    Giving an old key and its new key with different values is a ConfigError naming both.
    """
    aliases = getattr(cls, "KEY_ALIASES", {})
    if not any(old in data for old in aliases):
        return data
    where = f"{path}." if path else ""
    data = dict(data)
    for old, new in aliases.items():
        if old not in data:
            continue
        value, (*sections, leaf) = data.pop(old), new.split(".")
        node = data
        for name in sections:  # copy the sections on the way: the caller's dicts stay untouched
            section = node.get(name)
            if section is not None and not isinstance(section, dict):
                raise ConfigError(f"{where}{name}: expected a mapping to hold {where}{old}, got {section!r}")
            node[name] = node = dict(section or {})
        if leaf in node and node[leaf] != value:
            raise ConfigError(f"{where}{old}={value!r} and {where}{new}={node[leaf]!r} are both given: {where}{old} "
                              f"is the old name of {where}{new}; give only {where}{new}")
        warnings.warn(f"config key {where}{old} is deprecated: use {where}{new} (the old key is accepted until "
                      "the next release)", FutureWarning, stacklevel=2)
        node[leaf] = value
    return data


def from_dict(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ConfigError.
    Old keys the dataclass still accepts (``KEY_ALIASES``) are moved first (:func:`resolve_key_aliases`)."""
    data = resolve_key_aliases(cls, data, path)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names, key=str)  # YAML keys may be numbers or null, which do not sort with text
    if unknown:
        where = path or cls.__name__
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()}
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# presets and overrides


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def read_preset(preset: str, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a built-in preset name or a YAML path into a plain dict (``base:`` chains are merged).

    A ``base:`` path is relative to the folder of the preset that names it (a built-in name has no
    suffix). Cycles, chains longer than ``MAX_BASE_CHAIN`` and files outside the bounds of
    :mod:`.bounded_yaml` (size, alias expansion, nesting) raise ConfigError naming the file.
    """
    path = Path(preset)
    if not path.suffix and "/" not in preset:  # a built-in name; a path without a suffix is still a path
        path = PRESET_DIR / f"{preset}.yaml"
    elif _chain and not path.is_absolute():
        path = _chain[-1].parent / path
    if not path.exists():
        raise ConfigError(f"preset {preset!r}: no such file {path}; built-in presets: {preset_names()}")
    what = f"preset file {path}"
    if path.resolve() in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path.resolve()))
        raise ConfigError(f"{what}: base: chain returns to a preset it already read ({cycle})")
    if len(_chain) >= MAX_BASE_CHAIN:
        raise ConfigError(f"{what}: base: chain longer than {MAX_BASE_CHAIN} presets")
    try:
        data = load_bounded(read_preset_text(path, what), what) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{what}: malformed YAML at {_yaml_problem(err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"preset {preset!r}: top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str) or not base.strip():
            raise ConfigError(f"{what}: base: must be a preset name or a YAML path, got {short_repr(base)}")
        data = deep_merge(read_preset(base, (*_chain, path.resolve())), data)
    return data


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply ``a.b.0.c=value`` in place; the value is parsed as YAML (``3``, ``true``, ``[1, 2]``)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected dotted.key=value")
    key, raw = override.split("=", 1)
    what = f"override {short_repr(override)}"
    try:
        value = load_bounded(raw, what) if raw != "" else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"{what}: the value is malformed YAML at {_yaml_problem(err)}") from None
    parts = key.strip().split(".")
    if len(parts) > MAX_DEPTH:
        raise ConfigError(f"{what}: the key has {len(parts)} parts, more than any config field ({MAX_DEPTH})")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        node = _descend(node, part, key, create_list=nxt.isdigit())
    last = parts[-1]
    if isinstance(node, list):
        idx = _list_index(node, last, key)
        node[idx] = value
    else:
        node[last] = value


def _list_index(node: list, part: str, key: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override {key!r}: index {part!r} out of range (list has {len(node)} items)")
    return int(part)


def _descend(node: Any, part: str, key: str, create_list: bool) -> Any:
    if isinstance(node, list):
        return node[_list_index(node, part, key)]
    if not isinstance(node, dict):
        raise ConfigError(f"override {key!r}: {part!r} is not inside a mapping")
    if part not in node or node[part] is None:
        node[part] = [] if create_list else {}
    return node[part]


def load_config(preset: str | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Preset (name or path) + dotted overrides → a validated :class:`ExperimentConfig`."""
    data = read_preset(preset) if preset else {}
    if "agents" in data and isinstance(data["agents"], list):
        data["agents"] = [dict(a) if isinstance(a, dict) else a for a in data["agents"]]
    for ov in overrides or []:
        apply_override(data, ov)
    return validate(from_dict(ExperimentConfig, data))


