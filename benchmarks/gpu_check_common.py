"""What the steps of ``benchmarks/gpu_check.sh`` share: paths, the outcome exceptions, checks, the results file."""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT") or "gpu_check_out")
WHEELS = Path(os.environ.get("GPU_CHECK_WHEELS") or ROOT / ".whl")
SITE = Path(os.environ.get("GPU_CHECK_SITE") or Path(tempfile.gettempdir()) / "hacrl_gpu_site")


class Skip(Exception):
    """The step cannot run on this machine (printed as ``skipped: <message>``)."""


class Failed(Exception):
    """A check of the step failed (printed as ``FAILED: <message>``)."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise Failed(message)


def importable(module: str) -> bool:
    """Whether ``module`` can be found (a broken or hidden package counts as absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def need_cuda() -> None:
    """Skip without CUDA; when the env step already found no device, without importing torch again."""
    path = OUT / "results.json"
    env = json.loads(path.read_text()).get("env", {}) if path.exists() else {}
    if "device" in env and env["device"] is None:
        raise Skip("no CUDA")
    import torch

    if not torch.cuda.is_available():
        raise Skip("no CUDA")


def need(module: str, advice: str) -> None:
    """Skip unless ``module`` imports here (with what it imports itself, e.g. numpy for megatron.core)."""
    if not importable(module.split(".")[0]):
        raise Skip(f"{module} does not import ({advice})")
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise Skip(f"{module} does not import: {e} ({advice})") from None


def record(step: str, data: dict) -> None:
    """Merge ``data`` into ``$OUT/results.json`` under ``step``."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[step] = data
    path.write_text(json.dumps(results, indent=1, sort_keys=True))


def err(a, b) -> float:
    """max |a − b| in float64, wherever the two tensors live."""
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())
