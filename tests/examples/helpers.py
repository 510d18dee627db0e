"""Run an example the way its README says: the README's ```bash commands, in a scratch copy of the
example, with extra arguments that make it short. Keeps examples/ from rotting: a README command
that no longer works fails its test."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def readme_commands(example: str) -> list[str]:
    """The commands in ``examples/<example>/README.md``'s bash blocks: continuations joined,
    comments and blank lines dropped, in order."""
    lines, inside, pending = [], False, ""
    for raw in (EXAMPLES / example / "README.md").read_text().splitlines():
        if raw.strip().startswith("```"):
            inside = raw.strip() == "```bash" if not inside else False
            continue
        if not inside:
            continue
        text = pending + raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else pending
        if text.endswith("\\"):
            pending = text[:-1].rstrip() + " "
            continue
        pending = ""
        if text.strip():
            lines.append(" ".join(text.split()))
    return lines


def scratch(tmp_path: Path, *examples: str) -> Path:
    """A working directory laid out like the repository root for ``examples``: copies of those
    example folders (generated files land there, not in the checkout), tools/ linked."""
    work = tmp_path / "work"
    for name in examples:
        shutil.copytree(EXAMPLES / name, work / "examples" / name)
    (work / "tools").symlink_to(ROOT / "tools")
    return work


def run_failing(command: str, work: Path, *extra: str, env: dict[str, str] | None = None,
                timeout: int = 1500) -> subprocess.CompletedProcess:
    """Run one README command in ``work`` with ``extra`` arguments appended; any exit status."""
    argv = shlex.split(command) + list(extra)
    assigned = {}
    while "=" in argv[0] and argv[0].split("=", 1)[0].isidentifier():  # `NAME=value cmd ...`
        name, value = argv.pop(0).split("=", 1)
        assigned[name] = value
    if argv[0] == "hacrl":
        argv = [sys.executable, "-m", "hacrl_megatron", *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "HACRL_CACHE": str(work.parent / "cache"),
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **assigned, **(env or {})}
    return subprocess.run(argv, cwd=work, env=full_env, capture_output=True, text=True, timeout=timeout)


def run(command: str, work: Path, *extra: str, env: dict[str, str] | None = None,
        timeout: int = 1500) -> subprocess.CompletedProcess:
    """:func:`run_failing` that must exit 0; fails with the command's output."""
    out = run_failing(command, work, *extra, env=env, timeout=timeout)
    assert out.returncode == 0, f"{command}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


SHORT_TRAIN = ("train.steps=2", "train.eval_every=2", "data.eval_size=20", "checkpoint.every=0",
               "log.progress=false", "log.tensorboard=false")
