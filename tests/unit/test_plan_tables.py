"""docs/scaling.md's table and docs/planner.md's preset table are `hacrl plan`'s output
(tools/plan_tables.py renders them): a planner change that moves a number fails here until the
tables are regenerated (``python tools/plan_tables.py --write``)."""

from __future__ import annotations

import pytest

from tests.unit.tool_loading import ROOT, load_tool

tables = load_tool("plan_tables")
NINE = [r for r in tables.SCALING + tables.PRESETS if r.preset == "multinode_llama70b_qwen72b" and r.nodes == 9]


def _rows(name: str) -> list[str]:
    path = tables.TABLES[name][0]
    return tables.marked((ROOT / path).read_text(), name)


def test_9x8_rows_match_the_planner():
    """The default 9×8 preset's rows, clamp and decoupled (the fast part; the rest is slow)."""
    for name in tables.TABLES:
        rows = [r for r in tables.TABLES[name][1] if r in NINE]
        want = tables.render(name, tuple(rows))
        have = _rows(name)
        assert have[:2] == want[:2], f"{name}: header"
        for line in want[2:]:
            assert line in have, f"{tables.TABLES[name][0]}: row not as hacrl plan prints it:\n{line}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(tables.TABLES))
def test_whole_tables_match_the_planner(name):
    assert _rows(name) == tables.render(name)


def test_check_names_a_stale_table(tmp_path, monkeypatch, capsys):
    """--check exits 1 and names the file and table whose text differs; --write fixes it."""
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    row = tables.Row("multinode_llama70b_qwen72b", 9)
    monkeypatch.setattr(tables, "TABLES", {"scaling": ("README.md", (row,))})
    (tmp_path / "README.md").write_text("x\n<!-- plan-table: scaling -->\n| old |\n<!-- /plan-table -->\ny\n")
    assert tables.main(["--check"]) == 1
    assert "README.md: table 'scaling' differs from hacrl plan's output" in capsys.readouterr().err
    assert tables.main(["--write"]) == 0
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("x\n<!-- plan-table: scaling -->\n| preset, cluster |") and text.endswith("-->\ny\n")
    assert tables.main(["--check"]) == 0
