"""examples/ stays whole: every example folder is in the table of examples/README.md, has a README
with its commands, and names the test that runs it, which exists (fast; the runs are slow tests)."""

from __future__ import annotations

import re

from tests.examples.helpers import EXAMPLES, ROOT, readme_commands

OTHER_OWNERS = {"multi_node_70b"}  # written with the multi-node planner; linked from the table


def test_every_example_is_listed_has_commands_and_a_test():
    table = (EXAMPLES / "README.md").read_text()
    folders = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert folders, "no examples"
    for name in folders:
        assert f"[{name}]({name}/)" in table, f"examples/README.md does not list {name}"
        if name in OTHER_OWNERS:
            continue
        assert readme_commands(name), f"examples/{name}/README.md has no ```bash commands"
        readme = (EXAMPLES / name / "README.md").read_text()
        tests = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", readme)
        assert tests, f"examples/{name}/README.md does not name the test that runs it"
        for path, func in tests:
            assert re.search(rf"^def {func}\(", (ROOT / path).read_text(), re.M), f"{path}::{func} is missing"


def test_readme_commands_join_continuations_and_drop_comments(tmp_path, monkeypatch):
    import tests.examples.helpers as helpers

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "README.md").write_text(
        "text\n```bash\n# a comment\nhacrl train \\\n    a=1   # why\n\npython t.py\n```\n```python\nnot_a_command()\n```\n")
    monkeypatch.setattr(helpers, "EXAMPLES", tmp_path)
    assert helpers.readme_commands("x") == ["hacrl train a=1", "python t.py"]
