"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks: [tools/mkdocs_hooks.py]``).

The pages of ``docs/`` are read in two places: on GitHub, where a link such as
``../benchmarks/RESULTS.md`` or ``../hacrl_megatron/agents/packing.py`` resolves inside the repository,
and on the built site, which holds ``docs/`` only. MkDocs would leave such a link relative, pointing
at nothing on the site, and ``mkdocs build --strict`` fails on it. So before each page is rendered,
every relative Markdown link whose target lies outside ``docs_dir``:

* must name a file or folder that exists in the repository (a missing one fails the build, as a link
  to a missing page does), and
* becomes an absolute link to the repository's web view: ``<repo_url>/blob/<branch>/<path>`` for a
  file, ``<repo_url>/tree/<branch>/<path>`` for a folder, its ``#anchor`` kept.

``repo_url`` comes from ``mkdocs.yml`` (``$HACRL_DOCS_REPO_URL`` overrides it there), the branch from
``extra.source_branch`` (default ``main``). Links inside ``docs/`` are left to MkDocs' own validation,
and fenced code blocks and inline code spans are never touched. :func:`rewrite_outside_links` is the
whole rule, so ``tests/unit/test_docs_site.py`` checks it without building the site.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# an inline code span (left as it is) or an inline link/image: [text](target "title")
CODE_OR_LINK = re.compile(r"(?P<code>`+)(?:.+?)(?P=code)|(?P<head>!?\[[^\]]*\]\(\s*)<?(?P<target>[^)\s>]+)>?")
URL_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


class OutsideLinkError(ValueError):
    """Links of a page that point at files missing from the repository (or outside it); names each."""


def rewrite_outside_links(markdown: str, page_path: Path, docs_dir: Path, repo_root: Path,
                          repo_url: str | None, branch: str = "main") -> str:
    """``markdown`` of the page at ``page_path`` with its links to repository files outside ``docs_dir``
    made absolute (see the module docstring); raises :class:`OutsideLinkError` naming every link whose
    target is missing or leaves the repository, or when such links exist and no ``repo_url`` is set."""
    problems: list[str] = []
    base = repo_url.rstrip("/") if repo_url else None
    docs_dir, repo_root = docs_dir.resolve(), repo_root.resolve()

    def replace(match: re.Match) -> str:
        target = match.group("target")
        if match.group("code") or not target or target.startswith("#") or URL_SCHEME.match(target):
            return match.group(0)  # code, an anchor in this page, or a URL
        path_part, _, anchor = target.partition("#")
        resolved = (page_path.parent / path_part).resolve()
        if resolved == docs_dir or docs_dir in resolved.parents:
            return match.group(0)  # a page of the site: MkDocs validates and rewrites it
        if resolved != repo_root and repo_root not in resolved.parents:
            problems.append(f"{target!r} leaves the repository")
            return match.group(0)
        if not resolved.exists():
            problems.append(f"{target!r} points to a missing file ({resolved.relative_to(repo_root).as_posix()})")
            return match.group(0)
        if base is None:
            problems.append(f"{target!r} lies outside docs/ and mkdocs.yml sets no repo_url to link it to")
            return match.group(0)
        kind = "tree" if resolved.is_dir() else "blob"
        relative = posixpath.join(*resolved.relative_to(repo_root).parts) if resolved != repo_root else ""
        url = f"{base}/{kind}/{branch}/{relative}".rstrip("/") + (f"#{anchor}" if anchor else "")
        return match.group("head") + url

    out, in_fence = [], None
    for line in markdown.splitlines(keepends=True):
        fence = FENCE.match(line)
        if in_fence:
            if fence and fence.group(1)[0] == in_fence[0] and len(fence.group(1)) >= len(in_fence):
                in_fence = None
            out.append(line)
        elif fence:
            in_fence = fence.group(1)
            out.append(line)
        else:
            out.append(CODE_OR_LINK.sub(replace, line))
    if problems:
        raise OutsideLinkError(f"{page_path.name}: " + "; ".join(problems))
    return "".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: each page's Markdown before it is rendered."""
    from mkdocs.exceptions import PluginError

    docs_dir = Path(config["docs_dir"])
    repo_root = Path(config["config_file_path"]).resolve().parent
    try:
        return rewrite_outside_links(markdown, docs_dir / page.file.src_path, docs_dir, repo_root,
                                     config.get("repo_url"), (config.get("extra") or {}).get("source_branch", "main"))
    except OutsideLinkError as err:
        raise PluginError(f"docs/{err}") from None
