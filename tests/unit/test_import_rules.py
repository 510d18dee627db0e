"""The design's dependency rules between the package's stages, checked on the source with ``ast``.

Every import counts: at module level, inside functions (lazy imports of heavy backends) and under
``if TYPE_CHECKING:``. Rules (docs/architecture.md, "Layout"):

* ``algo/`` imports only torch (and the standard library, numpy) and ``config``: pure tensor math;
* ``kernels/`` imports only torch, triton, ``algo`` and ``config``;
* ``models/`` and ``agents/`` never import ``trainer/``, ``rollout/`` or ``reward/``;
* ``rollout/`` never imports ``agents/``;
* ``reward/``, ``data/`` and ``exchange/`` never import ``models/`` or ``agents/``;
* no import cycle between the package's units (subpackages and top-level modules);
* no import cycle between the package's modules either (``config/schema.py`` ↔ ``config/validation.py``
  through a lazy import was one), lazy imports inside functions included.

Two rules on what the code says rather than what it imports keep seams from leaking: no comparison
on the method switches outside ``algo/`` and ``config/``, and no engine HTTP route (``"/generate"``,
``"/update_weights_from_disk"``, ... as the clients of ``rollout/`` use them) outside ``rollout/``
(docs/architecture.md, "Seams").
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = "hacrl_megatron"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
STDLIB = set(sys.stdlib_module_names)

# unit -> (third-party modules it may import, or None for any; package units it may import, or None for any)
ONLY = {
    "algo": ({"torch", "numpy"}, {"algo", "config"}),
    "kernels": ({"torch", "triton"}, {"kernels", "algo", "config"}),
}
NEVER = {
    "models": {"trainer", "rollout", "reward"},
    "agents": {"trainer", "rollout", "reward"},
    "rollout": {"agents"},
    "reward": {"models", "agents"},
    "data": {"models", "agents"},
    "exchange": {"models", "agents"},
}


def unit_of(path: Path) -> str:
    """The package unit a source file belongs to: its subpackage, or the top-level module's name."""
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _module_of(path: Path) -> list[str]:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted module) of every import in ``path``, wherever it sits in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_of(path) if path.name == "__init__.py" else _module_of(path)[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            if module == PACKAGE:  # ``from hacrl_megatron import config``: the names are the units
                out += [(node.lineno, f"{PACKAGE}.{alias.name}") for alias in node.names]
    return out


def edges() -> list[tuple[str, str, str, int]]:
    """(unit, imported unit or third-party top-level module, file, line), one per import."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        unit = unit_of(path)
        for line, module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == PACKAGE:
                if len(parts) == 1:
                    continue  # the ``from hacrl_megatron import x`` line itself; x is listed separately
                target = parts[1]
            else:
                target = parts[0]
            out.append((unit, target, str(path.relative_to(ROOT.parent)), line))
    return out


def is_unit(name: str) -> bool:
    return (ROOT / name).is_dir() or (ROOT / f"{name}.py").is_file()


def rule_violations() -> list[str]:
    problems = []
    for unit, target, where, line in edges():
        if unit == target:
            continue
        internal = is_unit(target)
        if unit in ONLY:
            third_party, units = ONLY[unit]
            allowed = target in units if internal else (target in STDLIB or target in third_party)
            if not allowed:
                problems.append(f"{where}:{line}: {unit}/ imports {target} (allowed: the standard library, "
                                f"{sorted(third_party)}, {sorted(units)})")
        if internal and target in NEVER.get(unit, ()):
            problems.append(f"{where}:{line}: {unit}/ must not import {target}/")
    return problems


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for unit, target, _, _ in edges():
        graph.setdefault(unit, set())
        if unit != target and is_unit(target):
            graph[unit].add(target)
    return graph


def module_graph() -> dict[str, set[str]]:
    """Dotted module -> the package's modules it imports, wherever the import sits in the file.

    ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b`` (its
    ``__init__``); parent packages that Python initialises on the way are not edges.
    """
    files = {".".join(_module_of(p)): p for p in sorted(ROOT.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = _module_of(path) if path.name == "__init__.py" else _module_of(path)[:-1]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - (node.level - 1)] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets += [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one unit (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_stage_dependency_rules_hold():
    problems = rule_violations()
    assert not problems, "import rules broken:\n" + "\n".join(problems)


def test_no_import_cycles_between_units():
    graph = unit_graph()
    found = cycles(graph)
    detail = [" -> ".join(c) + ": " + "; ".join(f"{a} imports {sorted(graph[a] & set(c))}" for a in c)
              for c in found]
    assert not found, "import cycles between units:\n" + "\n".join(detail)


def test_no_import_cycles_between_modules():
    graph = module_graph()
    found = cycles(graph)
    detail = [" -> ".join(c) + ": " + "; ".join(f"{a} imports {sorted(graph[a] & set(c))}" for a in c)
              for c in found]
    assert not found, "import cycles between modules (lazy imports count):\n" + "\n".join(detail)


# ---- the checker itself ------------------------------------------------------------------------
def test_module_checker_sees_lazy_imports_and_submodules_named_in_from_imports(tmp_path, monkeypatch):
    pkg = tmp_path / PACKAGE
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text("from .schema import Rec\nfrom .rules import check\n")
    (pkg / "config" / "schema.py").write_text("class Rec:\n    def check(self):\n"
                                              "        from hacrl_megatron.config.rules import check\n")
    (pkg / "config" / "rules.py").write_text("from hacrl_megatron.config import schema\n")
    (pkg / "other.py").write_text("from hacrl_megatron.config import Rec\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    graph = module_graph()
    assert graph[f"{PACKAGE}.config.rules"] == {f"{PACKAGE}.config.schema"}  # a submodule, not the __init__
    assert graph[f"{PACKAGE}.other"] == {f"{PACKAGE}.config"}
    assert cycles(graph) == [[f"{PACKAGE}.config.rules", f"{PACKAGE}.config.schema"]]
    (pkg / "config" / "schema.py").write_text("class Rec:\n    pass\n")
    assert cycles(module_graph()) == []


def test_checker_sees_lazy_type_checking_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / PACKAGE
    for sub in ("algo", "kernels", "models", "agents", "trainer", "rollout", "exchange"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("import yaml\n")
    (pkg / "algo" / "math.py").write_text("import torch\nimport math\nfrom hacrl_megatron import config\n"
                                          "def f():\n    import transformers\n")
    (pkg / "kernels" / "k.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from hacrl_megatron.models import provider\n")
    (pkg / "agents" / "a.py").write_text("from ..trainer import loop\n")
    (pkg / "trainer" / "loop.py").write_text("from hacrl_megatron.agents import a\n")
    (pkg / "rollout" / "r.py").write_text("from . import x\nfrom .. import exchange\n")
    (pkg / "exchange" / "e.py").write_text("def g():\n    from hacrl_megatron.rollout import r\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    assert rule_violations() == [
        f"{PACKAGE}/agents/a.py:1: agents/ must not import trainer/",
        f"{PACKAGE}/algo/math.py:5: algo/ imports transformers (allowed: the standard library, "
        "['numpy', 'torch'], ['algo', 'config'])",
        f"{PACKAGE}/kernels/k.py:3: kernels/ imports models (allowed: the standard library, "
        "['torch', 'triton'], ['algo', 'config', 'kernels'])",
    ]
    assert cycles(unit_graph()) == [["agents", "trainer"], ["exchange", "rollout"]]


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_cycle_finder(graph, expected):
    assert cycles(graph) == expected


# ---- the algorithm is one object (algo/algorithm.py): nobody else asks which method runs ------------------
METHOD_FIELDS = {"algorithm", "cross_clip_mode", "cross_window"}  # hacpo.* switches that pick the method
METHOD_NAMES = {"hacpo", "gspo", "gspo_x2", "grpo", "naive", "naive_merge", "pessimistic", "decoupled"}
METHOD_UNITS = {"algo", "config"}


def _names_a_method(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr in METHOD_FIELDS:
        return True
    if isinstance(node, ast.Constant) and node.value in METHOD_NAMES:
        return True
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_names_a_method(e) for e in node.elts)


def method_comparisons(root: Path = None) -> list[str]:
    """``file:line`` of every comparison on a method switch or a method's name outside algo/ and config/."""
    root = root or ROOT
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in METHOD_UNITS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Compare) and any(_names_a_method(n) for n in (node.left, *node.comparators)):
                out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.match_case) and _names_a_method(getattr(node.pattern, "value", None)):
                out.append(f"{path.relative_to(root.parent)}:{node.pattern.lineno}: case {ast.unparse(node.pattern)}")
    return out


def test_only_the_algorithm_object_asks_which_method_runs():
    found = method_comparisons()
    assert not found, ("compare hacpo.algorithm / cross_clip_mode / cross_window only in algo/ and config/; "
                       "ask the Algorithm object (algo/algorithm.py) instead:\n" + "\n".join(found))


def test_method_comparison_checker_sees_fields_names_and_membership(tmp_path):
    pkg = tmp_path / PACKAGE
    for sub in ("trainer", "algo"):
        (pkg / sub).mkdir(parents=True)
    (pkg / "trainer" / "stages.py").write_text(
        "def f(exp, name):\n"
        "    a = exp.hacpo.algorithm == 'grpo'\n"
        "    b = name in ('naive', 'x')\n"
        "    c = exp.hacpo.cross_clip_mode != mode\n"
        "    d = exp.rollout.weight_sync == 'disk'\n")
    (pkg / "algo" / "algorithm.py").write_text("def g(cfg):\n    return cfg.algorithm == 'grpo'\n")
    assert [line.split(": ")[0] for line in method_comparisons(pkg)] == [
        f"{PACKAGE}/trainer/stages.py:2", f"{PACKAGE}/trainer/stages.py:3", f"{PACKAGE}/trainer/stages.py:4"]


# ---- an engine's routes stay in its client (rollout/): transports call the client's methods ---------------
ROUTE_UNIT = "rollout"
ROUTE = re.compile(r"/[a-z][a-z_]*")
# Linux's process filesystem, read by rollout/server_guard.py (a server's leftovers) and reward/pool.py
# (a checker's): a path, not an engine route
NOT_ROUTES = frozenset({"/proc"})
SGLANG_ROUTES = {"/generate", "/health", "/update_weights_from_disk", "/update_weights_from_tensor",
                 "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
                 "/release_memory_occupation", "/resume_memory_occupation"}


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions (prose may name a route)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def engine_routes(root: Path = None) -> set[str]:
    """The HTTP routes rollout/'s engine clients use: every plain string literal ``/name`` there (the
    pieces of f-strings, such as metric keys ``f"{engine}/tokens"``, are not routes)."""
    root = root or ROOT
    found = set()
    for path in sorted((root / ROUTE_UNIT).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in pieces
                    and ROUTE.fullmatch(node.value) and node.value not in NOT_ROUTES):
                found.add(node.value)
    return found


def route_strings(root: Path = None, routes: set[str] | None = None) -> list[str]:
    """``file:line`` of every string literal outside rollout/ (docstrings aside) that holds an engine route."""
    root = root or ROOT
    routes = engine_routes(root) if routes is None else routes
    pattern = re.compile("|".join(re.escape(r) + r"(?![a-z_])" for r in sorted(routes)))
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == ROUTE_UNIT:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        docs = _docstring_nodes(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                    and pattern.search(node.value)):
                out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.value!r}")
    return out


def test_engine_routes_are_spoken_only_by_the_engine_clients():
    assert SGLANG_ROUTES <= engine_routes()  # the checker reads the routes the SGLang client really uses
    found = route_strings()
    assert not found, ("an engine's HTTP routes belong to its client in rollout/; call the client's method "
                       "(rollout/protocol.py) instead:\n" + "\n".join(found))


def test_route_checker_sees_calls_and_f_strings_not_prose(tmp_path):
    pkg = tmp_path / PACKAGE
    for sub in ("rollout", "sync"):
        (pkg / sub).mkdir(parents=True)
    (pkg / "rollout" / "client.py").write_text('def load(c, name):\n    c.post("/update_weights_from_disk", {})\n'
                                               '    return f"{name}/tokens"\n')
    (pkg / "sync" / "disk.py").write_text(
        '"""Then the engine\'s /update_weights_from_disk."""\n'
        "def push(e, url):\n"
        '    """Calls /update_weights_from_disk."""\n'
        '    e.post("/update_weights_from_disk", {})\n'
        '    return f"{url}/update_weights_from_disk?x", "/update_weights_from_disk_v2"\n')
    assert engine_routes(pkg) == {"/update_weights_from_disk"}
    assert [line.split(": ")[0] for line in route_strings(pkg)] == [f"{PACKAGE}/sync/disk.py:4",
                                                                    f"{PACKAGE}/sync/disk.py:5"]
