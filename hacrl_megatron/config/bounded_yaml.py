"""YAML from presets and overrides, bounded before anything is built.

A preset is user input: a 341-byte file of nested aliases ("billion laughs") expands to billions of
values once anything walks it (the dataclass builder, ``repr`` in an error message), a FIFO or
``/dev/zero`` never ends, a 100,000-deep ``[[[...`` exhausts Python's recursion. So before the YAML
is built into Python objects:

1. the file must be a regular file of at most :data:`MAX_BYTES`, in UTF-8;
2. its event stream (the parser is a state machine: no recursion) is walked once, counting every
   value an alias stands for as often as the alias is used, and the nesting depth; more than
   :data:`MAX_VALUES` expanded values or :data:`MAX_DEPTH` levels is refused, naming the line.

Real presets are ~2 KB, ~200 values and 5 levels deep, far below every bound. Within the bounds a
load takes well under a second and a few MB (tests/faults/test_hostile_presets.py measures it).
"""

from __future__ import annotations

import os
import reprlib
import stat
from pathlib import Path, PurePath
from typing import Any

import yaml

from hacrl_megatron.config.schema import ConfigError

MAX_BYTES = 256 * 1024  # a preset (or one override value) larger than this is refused unread
MAX_VALUES = 20_000  # scalars and collections after alias expansion
MAX_DEPTH = 32  # nested mappings/sequences
MAX_BASE_CHAIN = 16  # presets in one ``base:`` chain

PATH_MAX = 4096  # Linux's limit on a path's length: a longer string cannot name a file


def looks_like_path(text: str) -> bool:
    """Whether ``text`` could be a file system path a user must be able to copy whole: it holds a
    separator, no line break, and is no longer than :data:`PATH_MAX`."""
    return ("/" in text or os.sep in text) and "\n" not in text and len(text) <= PATH_MAX


class _ShortRepr(reprlib.Repr):
    """``reprlib.Repr`` that never cuts a path: a user told a path with its middle replaced by ``...``
    cannot use it. Other long strings, long numbers and deep or long collections are still cut."""

    def repr_str(self, x: str, level: int) -> str:
        if looks_like_path(x):
            return repr(x)
        return super().repr_str(x, level)

    def repr1(self, x: Any, level: int) -> str:
        if isinstance(x, PurePath):
            return repr(str(x))
        return super().repr1(x, level)


_SHORT = _ShortRepr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlevel, _SHORT.maxlong = 80, 80, 3, 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 16  # a config's lists are short: show them


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to about a line (levels, items and characters elided with ``...``): error
    messages quote the offending value without expanding a huge or deeply nested one. A path (a
    ``PurePath``, or a string :func:`looks_like_path` accepts) is always quoted whole."""
    return _SHORT.repr(value)


def read_preset_text(path: Path, what: str) -> str:
    """The text of preset file ``path``; ConfigError naming ``what`` (e.g. ``preset file x.yaml``) when it
    is not a regular file (a folder, a FIFO, a device), larger than :data:`MAX_BYTES` or not UTF-8."""
    try:
        info = path.stat()
    except OSError as err:
        raise ConfigError(f"{what}: cannot be read ({err.strerror})") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{what}: is a folder, not a YAML file")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{what}: not a regular file (a FIFO, socket or device cannot be a preset)")
    if info.st_size > MAX_BYTES:
        raise ConfigError(f"{what}: {info.st_size} bytes, more than a preset may hold ({MAX_BYTES} bytes)")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # the file may have grown since stat
    except OSError as err:
        raise ConfigError(f"{what}: cannot be read ({err.strerror})") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{what}: more than a preset may hold ({MAX_BYTES} bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{what}: not UTF-8 text (byte {err.start}: {err.reason})") from None


def _line(event: yaml.Event) -> str:
    mark = event.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"


def check_bounds(text: str, what: str) -> None:
    """Walk the YAML events of ``text`` once; ConfigError when it would expand to more than
    :data:`MAX_VALUES` values or nest deeper than :data:`MAX_DEPTH`. Malformed YAML is left to the load
    that follows (it reports line, column and the expectation)."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{what}: {len(text)} characters, more than a value may hold ({MAX_BYTES})")
    fast = getattr(yaml, "CSafeLoader", None)  # libyaml's parser when present: 20x faster
    try:
        _walk(text, what, fast or yaml.SafeLoader)
    except yaml.YAMLError:  # malformed: the load that follows reports where; walk what the pure parser reads
        if fast is not None:
            try:
                _walk(text, what, yaml.SafeLoader)
            except yaml.YAMLError:
                pass


def _walk(text: str, what: str, loader: type) -> None:
    sizes: dict[str, int] = {}  # anchor -> values it expands to
    stack: list[tuple[str | None, int]] = [(None, 0)]  # (anchor, values so far) per open collection
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if len(stack) > MAX_DEPTH:
                raise ConfigError(f"{what}: nested more than {MAX_DEPTH} levels deep at {_line(event)}")
            stack.append((event.anchor, 1))
            continue
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, count = stack.pop()
        elif isinstance(event, yaml.ScalarEvent):
            anchor, count = event.anchor, 1
        elif isinstance(event, yaml.AliasEvent):
            anchor, count = None, sizes.get(event.anchor, 1)
        else:
            continue
        if anchor is not None:
            sizes[anchor] = count
        parent_anchor, parent_count = stack[-1]
        stack[-1] = (parent_anchor, parent_count + count)
        if parent_count + count > MAX_VALUES:
            raise ConfigError(f"{what}: expands to more than {MAX_VALUES} values at {_line(event)} "
                              "(a preset holds a few hundred; an alias counts once per use)")


def load_bounded(text: str, what: str) -> Any:
    """``yaml.safe_load(text)`` after :func:`check_bounds`; an integer too long for Python to convert is a
    ConfigError naming ``what``. Malformed YAML raises ``yaml.YAMLError`` for the caller to place."""
    check_bounds(text, what)
    try:
        return yaml.safe_load(text)
    except ValueError as err:  # int('9' * 5000): Python refuses to convert more than 4300 digits
        raise ConfigError(f"{what}: a value cannot be read ({str(err).split(';')[0]})") from None
