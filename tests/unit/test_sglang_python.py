"""rollout.sglang.python: the interpreter SGLang servers start with (SGLang in its own venv)."""

from __future__ import annotations

import re
import sys

import pytest

from hacrl_megatron.config import SGLANG_PYTHON_ENV, ConfigError, load_config
from hacrl_megatron.rollout.sglang_server import SGLangServer, sglang_python


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(SGLANG_PYTHON_ENV, raising=False)


def fake_python(tmp_path, mode=0o755):
    path = tmp_path / "venv" / "bin" / "python"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(mode)
    return path


def test_server_command_uses_given_interpreter(no_env, monkeypatch, tmp_path):
    server = SGLangServer(tmp_path / "m", port=31001, python="/opt/sglang/bin/python")
    assert server.command_line()[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert SGLangServer(tmp_path / "m", port=31001).command_line()[0] == sys.executable
    monkeypatch.setenv(SGLANG_PYTHON_ENV, "/venv/bin/python")  # the image's default, for direct users
    assert SGLangServer(tmp_path / "m", port=31001).command_line()[0] == "/venv/bin/python"
    assert SGLangServer(tmp_path / "m", port=31001, python="/x/python").command_line()[0] == "/x/python"


def test_resolution_order(no_env, monkeypatch, tmp_path):
    s = load_config("cpu_demo").rollout.sglang
    assert sglang_python(s.python) == sys.executable
    monkeypatch.setenv(SGLANG_PYTHON_ENV, "/from/env/python")
    assert sglang_python(s.python) == "/from/env/python"
    s.python = "/from/config/python"
    assert sglang_python(s.python) == "/from/config/python"


def test_valid_interpreter_passes(no_env, tmp_path):
    py = fake_python(tmp_path)
    cfg = load_config("cpu_demo", ["rollout.engine=sglang", f"rollout.sglang.python={py}"])
    assert sglang_python(cfg.rollout.sglang.python) == str(py)


def test_missing_interpreter_names_field_and_value(no_env, tmp_path):
    missing = tmp_path / "nope" / "python"
    with pytest.raises(ConfigError, match=rf"rollout\.sglang\.python='{re.escape(str(missing))}': must be an existing file"):
        load_config("cpu_demo", ["rollout.engine=sglang", f"rollout.sglang.python={missing}"])


def test_not_executable_is_rejected(no_env, tmp_path):
    py = fake_python(tmp_path, mode=0o644)  # no execute bit at all: X_OK fails even for root
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.python='.*': must be executable"):
        load_config("cpu_demo", ["rollout.engine=sglang", f"rollout.sglang.python={py}"])


def test_env_value_is_checked_and_named(monkeypatch, tmp_path):
    monkeypatch.setenv(SGLANG_PYTHON_ENV, str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.python \(from \$HACRL_SGLANG_PYTHON\)="):
        load_config("cpu_demo", ["rollout.engine=sglang"])


def test_only_checked_for_the_sglang_engine(no_env, tmp_path):
    cfg = load_config("cpu_demo", [f"rollout.sglang.python={tmp_path / 'absent'}"])  # engine: hf
    assert cfg.rollout.sglang.python == str(tmp_path / "absent")


def test_unused_with_a_custom_command(no_env, tmp_path):
    py = fake_python(tmp_path)
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.python=.*unused when rollout\.sglang\.command is set"):
        load_config("cpu_demo", ["rollout.engine=sglang", f"rollout.sglang.python={py}",
                                 "rollout.sglang.command=[srun,python]"])
