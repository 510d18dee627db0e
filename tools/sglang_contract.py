"""Extract SGLang's HTTP request contract from its released wheels, without importing sglang.

    python tools/sglang_contract.py [--versions 0.5.6.post2 0.5.23 ...] [--wheels DIR]
                                    [--out tests/fixtures/sglang_contract]

For each version: ``pip download --no-deps sglang==X`` (one ~10-40 MB wheel, nothing installed),
then ``ast`` over four files of the wheel:

- ``sglang/srt/managers/io_struct.py``: the request classes our client sends (fields with their
  annotation as source text, default as source text, and whether the field is required),
  following base classes defined in the same module (``BaseReq``'s ``rid``);
- ``sglang/srt/sampling/sampling_params.py``: ``SamplingParams``, the keys of ``sampling_params``
  (``__init__`` arguments in older releases, ``msgspec.Struct`` fields in newer ones);
- ``sglang/srt/entrypoints/http_server.py``: the route table (path, methods, body class);
- ``sglang/api/v1/api_types.py`` when present: the JSON schema the server checks ``/generate``
  bodies against, including whether unknown keys are rejected.

Module-level type aliases (``StringOrList = Union[str, StringList]``) are recorded so that a
validator can resolve annotations. The result is one JSON file per version, read by the stand-in
server in ``tests/fixtures/fake_sglang_server.py``: the real server drops unknown top-level keys
silently, so a misspelled field would otherwise never be caught on CPU.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VERSIONS = ("0.5.6.post2", "0.5.15.post1", "0.5.21", "0.5.23")
DEFAULT_OUT = REPO / "tests" / "fixtures" / "sglang_contract"

IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING = "sglang/srt/sampling/sampling_params.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
API_TYPES = "sglang/api/v1/api_types.py"

# The request classes behind the routes our client calls (rollout/sglang_engine.py).
REQUEST_CLASSES = (
    "GenerateReqInput",
    "UpdateWeightFromDiskReqInput",
    "UpdateWeightsFromTensorReqInput",
    "InitWeightsUpdateGroupReqInput",
    "UpdateWeightsFromDistributedReqInput",
    "DestroyWeightsUpdateGroupReqInput",
    "ReleaseMemoryOccupationReqInput",
    "ResumeMemoryOccupationReqInput",
    "FlushCacheReqInput",
    "BeginWeightUpdateReqInput",  # 0.5.21 and later: the session around tensor/distributed pushes
    "EndWeightUpdateReqInput",
)
SCHEMA_CLASSES = ("GenerateRequest", "SamplingParams", "WatermarkRequestConfig")
ROUTE_DECORATORS = {"get": ["GET"], "post": ["POST"], "put": ["PUT"], "delete": ["DELETE"]}


# --------------------------------------------------------------------------------------------
# download


def download(version: str, wheel_dir: Path) -> Path:
    """The sglang wheel of ``version`` in ``wheel_dir`` (``pip download --no-deps`` if missing)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(wheel_dir.glob(f"sglang-{version}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"sglang=={version}",
                        "-d", str(wheel_dir)], check=True)
        found = sorted(wheel_dir.glob(f"sglang-{version}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download of sglang=={version} left no wheel in {wheel_dir}")
    return found[0]


def read_members(wheel: Path) -> dict[str, str]:
    """Source text of the files this tool reads (absent files are left out)."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        return {m: zf.read(m).decode() for m in (IO_STRUCT, SAMPLING, HTTP_SERVER, API_TYPES) if m in names}


# --------------------------------------------------------------------------------------------
# classes


def _src(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _unwrap_field_default(value: ast.AST) -> tuple[str | None, bool]:
    """(default source, required) for a dataclass/msgspec default, unwrapping ``field(...)``."""
    if isinstance(value, ast.Call) and _src(value.func) in ("field", "dataclasses.field", "msgspec.field"):
        for kw in value.keywords:
            if kw.arg == "default":
                return _src(kw.value), False
            if kw.arg == "default_factory":
                return f"{_src(kw.value)}()", False
        return None, True
    return _src(value), False


def _is_classvar(annotation: ast.AST) -> bool:
    text = _src(annotation) or ""
    return text.startswith(("ClassVar", "typing.ClassVar"))


def _own_fields(cls: ast.ClassDef) -> list[dict]:
    fields = []
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and not _is_classvar(stmt.annotation):
            default, required = (None, True) if stmt.value is None else _unwrap_field_default(stmt.value)
            fields.append({"name": stmt.target.id, "type": _src(stmt.annotation), "default": default,
                           "required": required})
    return fields


def _init_fields(cls: ast.ClassDef) -> list[dict]:
    """Fields of a plain class from its ``__init__`` keyword arguments (old ``SamplingParams``)."""
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            args = stmt.args.args[1:] + stmt.args.kwonlyargs
            defaults = [None] * (len(stmt.args.args) - 1 - len(stmt.args.defaults)) + list(stmt.args.defaults)
            defaults += list(stmt.args.kw_defaults)
            return [{"name": a.arg, "type": _src(a.annotation), "default": _src(d), "required": d is None}
                    for a, d in zip(args, defaults)]
    return []


def _kind(cls: ast.ClassDef) -> str:
    """How the class is declared: its decorators and bases as source text (``@dataclass``, ``BaseReq``)."""
    return " ".join([f"@{_src(d)}" for d in cls.decorator_list] + [_src(b) for b in cls.bases])


def extract_classes(source: str, names: tuple[str, ...], module: str) -> dict[str, dict]:
    """Field lists of the classes ``names`` (those present) in ``source``, base classes first."""
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def fields_of(cls: ast.ClassDef) -> list[dict]:
        inherited: list[dict] = []
        for base in cls.bases:
            base_name = _src(base)
            if base_name in classes:
                inherited += fields_of(classes[base_name])
        own = _own_fields(cls) or _init_fields(cls)
        names_own = {f["name"] for f in own}
        return [f for f in inherited if f["name"] not in names_own] + own

    out = {}
    for name in names:
        if name in classes:
            cls = classes[name]
            doc = ast.get_docstring(cls) or ""
            entry = {"module": module, "kind": _kind(cls), "fields": fields_of(cls)}
            if "unknown keys rejected" in doc:
                entry["unknown_keys"] = "rejected"
            elif "unknown keys ignored" in doc:
                entry["unknown_keys"] = "ignored"
            out[name] = entry
    return out


def extract_aliases(source: str) -> dict[str, str]:
    """Module-level ``Name = <type expression>`` assignments (type aliases), as source text."""
    aliases = {}
    for stmt in ast.parse(source).body:
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and isinstance(stmt.value, (ast.Subscript, ast.Name, ast.BinOp))
                and stmt.targets[0].id[:1].isupper()):
            aliases[stmt.targets[0].id] = _src(stmt.value)
    return aliases


# --------------------------------------------------------------------------------------------
# routes


def _body_class(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    for arg in fn.args.args:
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and _src(ann.value) == "Annotated":
            ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
        name = _src(ann)
        if name and name.isidentifier() and name.endswith(("ReqInput", "Request")) and name != "Request":
            return name
    return None


def extract_routes(source: str) -> dict[str, dict]:
    """``path -> {"methods", "handler", "body"}`` for every ``@app.<verb>`` / ``@app.api_route`` route."""
    routes: dict[str, dict] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and _src(dec.func.value) == "app" and dec.args):
                continue
            path = dec.args[0]
            if not (isinstance(path, ast.Constant) and isinstance(path.value, str)):
                continue  # paths read from the environment (e.g. ollama routes)
            verb = dec.func.attr
            if verb == "api_route":
                methods = next((ast.literal_eval(k.value) for k in dec.keywords if k.arg == "methods"), ["GET"])
            elif verb in ROUTE_DECORATORS:
                methods = ROUTE_DECORATORS[verb]
            else:
                continue
            entry = routes.setdefault(path.value, {"methods": [], "handler": node.name, "body": _body_class(node)})
            entry["methods"] = sorted(set(entry["methods"]) | set(methods))
    return dict(sorted(routes.items()))


# --------------------------------------------------------------------------------------------
# one version


def contract(version: str, wheel: Path) -> dict:
    """The JSON-ready contract of one wheel."""
    files = read_members(wheel)
    missing = [m for m in (IO_STRUCT, SAMPLING, HTTP_SERVER) if m not in files]
    if missing:
        raise ValueError(f"{wheel.name}: missing {missing}; the wheel layout changed, update tools/sglang_contract.py")
    classes = extract_classes(files[IO_STRUCT], REQUEST_CLASSES, IO_STRUCT)
    classes.update(extract_classes(files[SAMPLING], ("SamplingParams",), SAMPLING))
    out = {
        "sglang_version": version,
        "wheel": wheel.name,
        "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "classes": classes,
        "aliases": {**extract_aliases(files[SAMPLING]), **extract_aliases(files[IO_STRUCT])},
        "routes": extract_routes(files[HTTP_SERVER]),
        "http_schema": None,
    }
    if API_TYPES in files:
        out["http_schema"] = {"module": API_TYPES,
                              "classes": extract_classes(files[API_TYPES], SCHEMA_CLASSES, API_TYPES),
                              "aliases": extract_aliases(files[API_TYPES])}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="+", default=list(DEFAULT_VERSIONS))
    parser.add_argument("--wheels", type=Path, default=Path("sglang_wheels"), help="download cache")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for version in args.versions:
        data = contract(version, download(version, args.wheels))
        path = args.out / f"{version}.json"
        path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
        print(f"{version}: {len(data['classes'])} classes, {len(data['routes'])} routes -> {path}")


if __name__ == "__main__":
    main()
