"""The repository documents itself: no file points at documents outside it, and doc links resolve.

A user who clones the repository has only what git tracks. Every tracked text file is scanned for
references to paths outside the repository (private notes, absolute home or workspace paths);
Markdown links in README.md, docs/ and examples/ must point at files that exist inside the
repository; and every "docs/<page>.md §N" citation must name an existing page and section.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
BINARY_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".pdf", ".gguf", ".safetensors", ".pt", ".bin", ".gz", ".whl"}

# (pattern, why it is an outside reference); matched case-sensitively unless the pattern says otherwise
OUTSIDE = [
    (re.compile(r"\.\./shared"), "a folder next to the repository"),
    (re.compile(r"HACPO_SPEC"), "a private spec: cite docs/algorithm.md or the paper's equation"),
    (re.compile(r"(?i)\bspec\s*§"), "a private spec section: cite docs/algorithm.md §N"),
    (re.compile(r"\bresearch/[\w.-]+\.md"), "a private research note: cite docs/measured.md §N"),
    (re.compile(r"\b(?:feasibility|calibration|offline_data_models|perf_anchors|anchors_frameworks)"
                r"(?:\.md\b|\s+§)"), "a private research note: cite docs/measured.md §N"),
    (re.compile(r"\b(?:DESIGN|STYLE)(?:\.md\b|\s+rule\b|:)"), "a private design note: cite docs/architecture.md"),
    (re.compile(r"(?<![\w.])/work/"), "an absolute workspace path"),
    # /home/hacrl is the home of the container image's own user (Dockerfile), not a developer's machine
    (re.compile(r"(?<![\w.])/(?:home|Users)/(?!hacrl\b)[\w.-]+"), "an absolute home path"),
    (re.compile(r"(?<![\w.])/root/"), "an absolute home path"),
]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CITATION = re.compile(r"\bdocs/([\w-]+\.md)((?:(?:,\s*|\s+and\s+|\s+)§\s?\d+[a-z]?(?:\s?[-–]\s?\d+[a-z]?)?)*)")
SECTION_HEADING = re.compile(r"^#{2,3}\s+(\d+[a-z]?)\.", re.M)
SECTION_NUMBER = re.compile(r"\d+[a-z]?")


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked file list is unknown")
    files = [ROOT / name for name in out.decode().split("\0") if name]
    return [f for f in files if f.is_file() and f.suffix.lower() not in BINARY_SUFFIXES]


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    out = {}
    for path in _tracked_files():
        text = _text(path)
        if text is not None:
            out[path.relative_to(ROOT).as_posix()] = text
    assert "README.md" in out, "README.md is not tracked"
    return out


def _hits(text: str, pattern: re.Pattern) -> list[tuple[int, str]]:
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in pattern.finditer(text)]


def test_no_file_references_a_path_outside_the_repository(texts):
    problems = []
    for name, text in texts.items():
        if name == THIS:
            continue  # the patterns themselves
        for pattern, why in OUTSIDE:
            problems += [f"{name}:{line}: {found!r} ({why})" for line, found in _hits(text, pattern)]
    assert not problems, "references outside the repository:\n" + "\n".join(problems)


def _doc_pages(texts: dict[str, str]) -> list[str]:
    return [n for n in texts if n == "README.md" or (n.startswith("docs/") and n.endswith(".md"))
            or (n.startswith("examples/") and n.endswith("README.md"))]


def test_markdown_links_point_to_files_inside_the_repository(texts):
    problems = []
    for name in _doc_pages(texts):
        for line, link in _hits(texts[name], LINK):
            target = LINK.match(link).group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # a URL (http:, mailto:) or an anchor in the same page
            path = (ROOT / name).parent / target.split("#", 1)[0]
            resolved = path.resolve()
            if ROOT != resolved and ROOT not in resolved.parents:
                problems.append(f"{name}:{line}: link {target!r} leaves the repository")
            elif not resolved.exists():
                problems.append(f"{name}:{line}: link {target!r} points to a missing file")
    assert not problems, "broken Markdown links:\n" + "\n".join(problems)


def test_docs_citations_name_existing_pages_and_sections(texts):
    problems = []
    for name, text in texts.items():
        if name == THIS:
            continue
        for line, found in _hits(text, CITATION):
            match = CITATION.match(found)
            page = ROOT / "docs" / match.group(1)
            if not page.is_file():
                problems.append(f"{name}:{line}: {found!r} cites a missing page docs/{match.group(1)}")
                continue
            sections = set(SECTION_HEADING.findall(page.read_text(encoding="utf-8")))
            missing = sorted(set(SECTION_NUMBER.findall(match.group(2))) - sections)
            if missing:
                problems.append(f"{name}:{line}: {found!r} cites missing section(s) {missing}")
    assert not problems, "citations of docs/ that do not resolve:\n" + "\n".join(problems)


@pytest.mark.parametrize("text, expected", [
    ("see ../shared/HACPO_SPEC.md", 2),
    ("the spec §3 ratio", 1),
    ("Spec § 4", 1),
    ("(research/feasibility.md §5)", 2),
    ("calibration.md: a threshold", 1),
    ("(feasibility §6)", 1),
    ("DESIGN.md data flow; STYLE rule 12; DESIGN: sync/", 3),
    ("/work/main/x and /home/alice/y and /root/.cache", 3),
    ("docs/algorithm.md §5, ~/.cache/hacrl_megatron, calibration of the demo, /tmp/x, the design", 0),
    ("ENV HOME=/home/hacrl", 0),
])
def test_the_outside_patterns_catch_what_they_should(text, expected):
    assert sum(len(_hits(text, p)) for p, _ in OUTSIDE) == expected


def test_citation_pattern_reads_section_lists():
    match = CITATION.search("(docs/algorithm.md §3-5, §5a and §11; paper eq. 10)")
    assert match.group(1) == "algorithm.md"
    assert SECTION_NUMBER.findall(match.group(2)) == ["3", "5", "5a", "11"]
    assert SECTION_HEADING.findall("## 5. Cross\n### 5a. Variant\n## Decisions\n") == ["5", "5a"]
