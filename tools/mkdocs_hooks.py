"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks: [tools/mkdocs_hooks.py]``).

The pages of ``docs/`` are read in two places: on GitHub, where a link such as
``../benchmarks/RESULTS.md`` or ``../hacrl_megatron/agents/packing.py`` resolves inside the repository,
and on the built site, which holds ``docs/`` only. MkDocs would leave such a link relative, pointing
at nothing on the site, and ``mkdocs build --strict`` fails on it. So before each page is rendered,
every relative Markdown link whose target lies outside ``docs_dir``:

* must name a file or folder that exists in the repository (a missing one fails the build, as a link
  to a missing page does), and
* becomes, when ``mkdocs.yml`` names a ``repo_url`` (``$HACRL_DOCS_REPO_URL``), an absolute link to the
  repository's web view: ``<repo_url>/blob/<branch>/<path>`` for a file, ``<repo_url>/tree/<branch>/<path>``
  for a folder, its ``#anchor`` kept; without one, a relative link to a copy of that file or folder
  under ``_repository/`` in the built site (copied after the build), so the site stands alone.

The branch comes from ``extra.source_branch`` (default ``main``). Links inside ``docs/`` are left to MkDocs' own validation,
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


COPY_DIR = "_repository"  # where the site keeps its copies of repository files when there is no repo_url


def rewrite_outside_links(markdown: str, page_path: Path, docs_dir: Path, repo_root: Path,
                          repo_url: str | None, branch: str = "main", site_prefix: str = "",
                          copied: set[str] | None = None) -> str:
    """``markdown`` of the page at ``page_path`` with its links to repository files outside ``docs_dir``
    rewritten (see the module docstring); raises :class:`OutsideLinkError` naming every link whose
    target is missing or leaves the repository. ``site_prefix``: the relative path from the page's
    built HTML to the site's root (``../`` per folder level); ``copied`` collects the repository paths
    the site must copy (no ``repo_url``)."""
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
        kind = "tree" if resolved.is_dir() else "blob"
        relative = posixpath.join(*resolved.relative_to(repo_root).parts) if resolved != repo_root else ""
        if base is None:
            if not relative:
                problems.append(f"{target!r} is the whole repository: the site cannot copy it (set repo_url)")
                return match.group(0)
            if copied is not None:
                copied.add(relative)
            return match.group("head") + f"{site_prefix}{COPY_DIR}/{relative}" + (f"#{anchor}" if anchor else "")
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


_COPIES: set[str] = set()  # repository paths linked from the pages of this build (no repo_url)


def on_pre_build(config: Any) -> None:
    """MkDocs event: a build starts (``mkdocs serve`` rebuilds in one process)."""
    _COPIES.clear()


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: each page's Markdown before it is rendered."""
    from mkdocs.exceptions import PluginError

    docs_dir = Path(config["docs_dir"])
    repo_root = Path(config["config_file_path"]).resolve().parent
    try:
        return rewrite_outside_links(markdown, docs_dir / page.file.src_path, docs_dir, repo_root,
                                     config.get("repo_url"), (config.get("extra") or {}).get("source_branch", "main"),
                                     site_prefix="../" * page.url.count("/"), copied=_COPIES)
    except OutsideLinkError as err:
        raise PluginError(f"docs/{err}") from None


def on_post_build(config: Any) -> None:
    """MkDocs event: the site is written; copy the repository files its pages link to (no repo_url)."""
    import shutil

    repo_root = Path(config["config_file_path"]).resolve().parent
    target_root = Path(config["site_dir"]) / COPY_DIR
    for relative in sorted(_COPIES):
        source, target = repo_root / relative, target_root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".venv*", "site"))
        else:
            shutil.copy2(source, target)
