"""README and CI must not drift: CI runs exactly the README's test command, and the README's
commands only name presets and sub-commands that exist."""

import re
from pathlib import Path

from hacrl_megatron.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md needs a '## Quick start' section with a bash block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_has_exactly_two_setup_commands():
    assert len(_readme_commands()) == 2


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = _readme_commands()[1]
    assert "pytest" in test_command
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_ci_runs_the_readme_test_command_under_a_long_tmpdir_with_spaces():
    """The test command meets a temporary folder as users have them: with spaces, and long enough that a
    socket under it passes AF_UNIX's 107 bytes (the CI checkout's own path comes in front of it)."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    before = lines[: lines.index(_readme_commands()[1])]
    exports = [line for line in before if line.startswith("export TMPDIR=")]
    assert exports and exports[-1] == 'export TMPDIR="$CI_TMPDIR"'
    value = [line for line in before if line.startswith("CI_TMPDIR=")][-1].split("=", 1)[1].strip('"')
    assert value.startswith("$PWD/") and " " in value and len(value) >= 80


def test_readme_main_command_is_a_real_cli_call():
    main_command = _readme_commands()[0]
    assert main_command.endswith("hacrl train")
    assert build_parser().parse_args(["train"]).command == "train"
