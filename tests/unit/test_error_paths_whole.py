"""A path in an error message is never cut: a user must be able to copy it. Long values that are not
paths (a huge string, a long list, a long number) are still cut to about a line."""

from __future__ import annotations

from pathlib import Path

import pytest

from hacrl_megatron.config import ConfigError, load_config
from hacrl_megatron.config.bounded_yaml import short_repr
from hacrl_megatron.errors import one_line_text

LONG_DIR = "/tmp/" + "a folder with spaces " * 12 + "/" + "x" * 120 + "/nested"


def test_short_repr_keeps_a_long_path_whole():
    assert short_repr(LONG_DIR) == repr(LONG_DIR)
    assert short_repr(Path(LONG_DIR)) == repr(LONG_DIR)
    assert short_repr([LONG_DIR, "b"]) == repr([LONG_DIR, "b"])
    assert short_repr({"path": LONG_DIR}) == repr({"path": LONG_DIR})


def test_short_repr_still_cuts_what_is_not_a_path():
    assert "..." in short_repr("w" * 500) and len(short_repr("w" * 500)) < 100
    assert "..." in short_repr("a/b\n" * 200)  # holds a separator but spans lines: text, not a path
    assert "..." in short_repr("/" * 5000)  # longer than any path can be
    assert "..." in short_repr(list(range(100)))
    assert "..." in short_repr(10 ** 200)


def test_config_error_quotes_a_long_missing_path_whole(tmp_path):
    missing = tmp_path / ("deep folder " * 10) / "nope" / "python"
    with pytest.raises(ConfigError) as info:
        load_config("cpu_demo", ["rollout.engine=sglang", f"rollout.sglang.python={missing}"])
    assert f"'{missing}'" in str(info.value) and "..." not in str(info.value)


def test_one_line_text_never_cuts_inside_a_quoted_path():
    quoted = repr(LONG_DIR + "/config.json")
    message = "[Errno 2] No such file or directory: " + quoted + " while loading " + "w" * 100
    cut = one_line_text(message, limit=60)  # the path does not count: the reason after it is still shown
    assert cut == message[: message.index(quoted) + len(quoted) + 60 - len("[Errno 2] No such file or directory: ")] + "..."
    assert quoted + " while loading" in cut


def test_one_line_text_never_cuts_inside_an_unquoted_path_word():
    path = "/tmp/" + "y" * 400 + "/weights.safetensors"
    assert one_line_text(f"cannot open {path} now: it is gone", limit=40) == f"cannot open {path} now: it is gone"
    cut = one_line_text(f"cannot open {path} now: " + "z" * 100, limit=40)
    assert cut == f"cannot open {path} now: " + "z" * (40 - len("cannot open  now: ")) + "..."


def test_one_line_text_cuts_plain_text_and_joins_lines():
    assert one_line_text("a\n  b\tc") == "a b c"
    assert one_line_text("word " * 100, limit=20) == ("word " * 100)[:20] + "..."
    assert one_line_text("short", limit=20) == "short"
