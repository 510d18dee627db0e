"""The README stays a five-minute read and docs/ stays one site: every page in mkdocs.yml's nav, every
relative link and anchor of README.md and docs/ resolving (on GitHub and on the built site), the presets
table naming exactly the registered presets once each, and the features table short, with a status from
a fixed set. The site's own build (`mkdocs build --strict`, .ci/run's docs step) runs here too when
mkdocs-material is installed."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from hacrl_megatron.config import preset_names
from tests.unit.tool_loading import ROOT, load_tool

hooks = load_tool("mkdocs_hooks")

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300
FEATURES_MAX_ROWS = 20
FEATURE_STATUSES = {"works on CPU", "works on CPU; GPU not yet run", "GPU-only, not yet run", "planned"}
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


# ---- reading Markdown as GitHub does ---------------------------------------------------------
def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fence = [], None
    for line in text.splitlines():
        mark = hooks.FENCE.match(line)
        if fence:
            if mark and mark.group(1)[0] == fence[0] and len(mark.group(1)) >= len(fence):
                fence = None
        elif mark:
            fence = mark.group(1)
        else:
            out.append(line)
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (mkdocs.yml's pymdownx slugify gives the same): the rendered
    text lower-cased, everything but letters, digits, '_', '-' and spaces dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeated headings numbered as GitHub numbers them."""
    seen: Counter = Counter()
    out = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            out.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return out


def relative_links(path: Path) -> list[str]:
    """The relative targets of the inline links and images of a Markdown file (not in code)."""
    links = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in hooks.CODE_OR_LINK.finditer(line):
            target = match.group("target")
            if match.group("code") or not target or hooks.URL_SCHEME.match(target):
                continue
            links.append(target)
    return links


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _mkdocs_config() -> dict:
    """mkdocs.yml as data: its `!ENV` and `!!python/...` tags read as plain values."""
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


def _nav_files(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in _nav_files(value)]
    return [f for item in nav for f in _nav_files(item)]


def _table(text: str, header: str) -> list[list[str]]:
    """The body rows of the Markdown table that starts with ``header``, as lists of cells."""
    block = text.split(header + "\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]  # after the |---| line
    return [[cell.strip() for cell in row.strip().strip("|").split(" | ")] for row in block]


# ---- the README ---------------------------------------------------------------------------------
def test_readme_is_a_short_read():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail into docs/ (at most {README_MAX_LINES})"


def test_presets_table_names_every_registered_preset_once():
    rows = _table(README.read_text(encoding="utf-8"), "| preset | what | runs on |")
    listed = Counter(re.match(r"`([a-z0-9_]+)`", row[0]).group(1) for row in rows)
    assert [name for name, n in listed.items() if n > 1] == [], "a preset listed twice"
    assert set(listed) == set(preset_names()), (sorted(set(preset_names()) - set(listed)),
                                                sorted(set(listed) - set(preset_names())))


def test_features_table_is_short_and_each_status_is_one_of_the_set():
    rows = _table(README.read_text(encoding="utf-8"), "| feature | status | more |")
    assert 0 < len(rows) <= FEATURES_MAX_ROWS, f"{len(rows)} feature rows: the full list is docs/status.md"
    odd = [(row[0], row[1]) for row in rows if row[1] not in FEATURE_STATUSES]
    assert not odd, f"statuses outside {sorted(FEATURE_STATUSES)}: {odd}"


# ---- the site -----------------------------------------------------------------------------------
def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    config = _mkdocs_config()
    assert config["docs_dir"] == "docs" and config["strict"] is True
    assert "tools/mkdocs_hooks.py" in config["hooks"]
    nav = _nav_files(config["nav"])
    assert len(nav) == len(set(nav)), "a page listed twice in the nav"
    pages = {p.name for p in DOCS.glob("*.md")}
    assert set(nav) == pages, {"not in the nav": sorted(pages - set(nav)), "missing pages": sorted(set(nav) - pages)}


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve_to_files_and_headings(page):
    problems = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            problems.append(f"{target!r}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target!r}: {resolved.relative_to(ROOT)} has no heading with anchor #{anchor}")
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_docs_extra_pins_mkdocs_material_and_ci_builds_the_site_strictly():
    setup = (ROOT / "setup.py").read_text()
    assert re.search(r'"docs": \["mkdocs-material==\d+\.\d+\.\d+"\]', setup)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert 'pip install -q -e ".[docs]"' in ci
    build = [line for line in ci if "mkdocs build" in line]
    assert build and "--strict" in build[0] and '--site-dir "$DOCS_SITE_DIR/site"' in build[0]
    assert "site/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict` as .ci/run runs it (about a second), where the docs extra is installed."""
    pytest.importorskip("material", reason="the docs extra (mkdocs-material) is not installed")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "scaling" / "index.html").is_file()


# ---- the hook: links out of docs/ ---------------------------------------------------------------
@pytest.fixture
def repo(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "RESULTS.md").write_text("# Results\n")
    (tmp_path / "README.md").write_text("# x\n")
    return tmp_path


def _rewrite(repo: Path, markdown: str, repo_url: str | None = "https://git.example/o/r") -> str:
    return hooks.rewrite_outside_links(markdown, repo / "docs" / "page.md", repo / "docs", repo, repo_url)


def test_links_out_of_docs_become_repository_links_and_the_rest_stays(repo):
    text = ("See [results](../benchmarks/RESULTS.md#vllm-cpu-engine), ![a](../README.md) and the\n"
            "[folder](../benchmarks/), a [page](other.md#x), [here](#y) and [web](https://a.example/b).\n"
            "`[code](../missing.md)`\n```\n[fenced](../missing.md)\n```\n")
    out = _rewrite(repo, text)
    assert "[results](https://git.example/o/r/blob/main/benchmarks/RESULTS.md#vllm-cpu-engine)" in out
    assert "![a](https://git.example/o/r/blob/main/README.md)" in out
    assert "[folder](https://git.example/o/r/tree/main/benchmarks)" in out
    for kept in ("[page](other.md#x)", "[here](#y)", "[web](https://a.example/b)", "`[code](../missing.md)`",
                 "[fenced](../missing.md)"):
        assert kept in out


@pytest.mark.parametrize("link, why", [("../benchmarks/NOPE.md", "points to a missing file (benchmarks/NOPE.md)"),
                                       ("../../elsewhere.md", "leaves the repository")])
def test_a_link_out_of_docs_to_a_missing_file_fails_the_build(repo, link, why):
    with pytest.raises(hooks.OutsideLinkError, match=re.escape(f"page.md: {link!r} {why}")):
        _rewrite(repo, f"[x]({link})\n")


def test_without_a_repo_url_links_out_of_docs_point_at_the_sites_copies(repo):
    """No repository address: the site carries copies of what its pages link to (``_repository/``)."""
    copied: set[str] = set()
    out = hooks.rewrite_outside_links("[r](../benchmarks/RESULTS.md#x) and [f](../benchmarks/) and [p](page.md)\n",
                                      repo / "docs" / "page.md", repo / "docs", repo, None, site_prefix="../",
                                      copied=copied)
    assert out == "[r](../_repository/benchmarks/RESULTS.md#x) and [f](../_repository/benchmarks) and [p](page.md)\n"
    assert copied == {"benchmarks/RESULTS.md", "benchmarks"}
    with pytest.raises(hooks.OutsideLinkError, match="points to a missing file"):
        _rewrite(repo, "[x](../NOPE.md)\n", repo_url=None)  # still checked without a repo_url
    with pytest.raises(hooks.OutsideLinkError, match="whole repository"):
        _rewrite(repo, "[x](../)\n", repo_url=None)


def test_github_slugs_of_the_headings_the_docs_link_to():
    assert github_slug("10a. The paper's regimes on CPU: `cpu_state` and `cpu_size`") == \
        "10a-the-papers-regimes-on-cpu-cpu_state-and-cpu_size"
    assert github_slug("Run folder (`output_dir`)") == "run-folder-output_dir"
    assert github_slug("12a. HACPO, GSPO×2 and Naive on the CPU demo") == "12a-hacpo-gspo2-and-naive-on-the-cpu-demo"
