"""benchmarks/gpu_check.sh on CPU, under a simulated lent machine: runs to completion, one line per step.

The lent machine has torch and triton but no megatron-core, Transformer Engine, Ray, SGLang or vLLM;
a ``sitecustomize`` on PYTHONPATH makes those (and transformers) fail to import here. Carried wheels
come from a temporary folder: one for a package that does not import (unpacked) and one for a
package that does (left alone). One step's interpreter is made to crash, and the steps after it
must still report. Without CUDA every GPU step reports "skipped: no CUDA"; nothing is written to
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
HIDDEN = "megatron,transformer_engine,ray,sglang,vllm,transformers"
SITECUSTOMIZE = """
import importlib.abc, os, sys
HIDE = set(filter(None, os.environ.get("HIDE_MODULES", "").split(",")))
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDE:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Hide())
"""


def steps_module():
    spec = importlib.util.spec_from_file_location("gpu_check_steps", ROOT / "benchmarks" / "gpu_check_steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wheel(path: Path, package: str) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{package}/__init__.py", "VALUE = 7\n")
        z.writestr(f"{package}-1.0.dist-info/top_level.txt", f"{package}\n")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("gpu_check")
    (tmp / "hide").mkdir()
    (tmp / "hide" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    wheels = tmp / "wheels"
    wheels.mkdir()
    wheel(wheels / "fake_carried_pkg-1.0-py3-none-any.whl", "fake_carried_pkg")
    wheel(wheels / "PyYAML-6.0-cp312-cp312-manylinux_2_28_x86_64.whl", "yaml")  # imports here: left alone
    crash = tmp / "python"  # this machine's Python, except that the tp_mask step crashes
    crash.write_text(f'#!/bin/sh\nif [ "$2" = tp_mask ]; then echo "boom: injected" >&2; exit 3; fi\n'
                     f'exec "{sys.executable}" "$@"\n')
    crash.chmod(0o755)
    env = {**os.environ, "HIDE_MODULES": HIDDEN, "PYTHONPATH": str(tmp / "hide"), "PYTHON": str(crash),
           "OUT": str(tmp / "out"), "GPU_CHECK_SITE": str(tmp / "site"), "GPU_CHECK_WHEELS": str(wheels)}
    before = (ROOT / "benchmarks" / "RESULTS.md").read_bytes()
    res = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return {"res": res, "out": tmp / "out", "site": tmp / "site",
            "results_md_unchanged": (ROOT / "benchmarks" / "RESULTS.md").read_bytes() == before}


def test_runs_to_completion_with_one_line_per_step(run):
    res = run["res"]
    assert res.returncode == 0, res.stderr[-3000:]
    lines = (run["out"] / "summary.txt").read_text().splitlines()
    names = [ln.split()[0] for ln in lines]
    assert names == list(steps_module().STEPS)  # every step, in order, even after the crash
    outcome = {ln.split()[0]: re.sub(r" \(\d+ s\)$", "", ln.split(None, 1)[1]) for ln in lines}
    assert outcome["tp_mask"] == "FAILED: exit 3, boom: injected"
    for name in ("kernel", "bench", "megatron", "agent", "ipc", "invariance", "report"):
        assert outcome[name] == "skipped: no CUDA", (name, outcome[name])
    assert outcome["env"].startswith("python ") and "no CUDA device; carried wheels: 2" in outcome["env"]
    assert outcome["wheels"].startswith("unpacked 1 ") and "fake_carried_pkg" in outcome["wheels"]
    assert "already importable: 1" in outcome["wheels"]
    assert "gpu_check: done in" in res.stdout


def test_simulated_machine_and_results(run):
    results = json.loads((run["out"] / "results.json").read_text())
    present = results["env"]["present"]
    assert not any(present[m] for m in ("megatron", "transformer_engine", "ray", "sglang", "vllm", "transformers"))
    assert results["env"]["step_imports_failed"] == []  # the GPU steps' imports need none of them
    assert (run["site"] / "fake_carried_pkg" / "__init__.py").read_text() == "VALUE = 7\n"
    assert not (run["site"] / "yaml").exists()
    files = [p for p in run["out"].rglob("*") if p.is_file()]
    assert 1 <= len(files) <= 8, files
    assert run["results_md_unchanged"]


def test_step_limits_fit_the_lent_budget():
    text = SCRIPT.read_text()
    steps = re.search(r"^STEPS=\((.*)\)$", text, re.M).group(1).split()
    kill = int(re.search(r"^KILL_AFTER=(\d+)", text, re.M).group(1))
    limits = {s.split(":")[0]: int(s.split(":")[1]) for s in steps}
    assert list(limits) == list(steps_module().STEPS)
    assert sum(limits.values()) + kill * len(limits) <= 9 * 60  # a second run fits the 15 minutes
    for needed in ("What a lent H200 answers", "What still needs a full cluster", "pip download",
                   "--python-version 3.12", "-d .whl", "carry=[\".whl\"]"):
        assert needed in text, needed
    assert ".whl/" in (ROOT / ".gitignore").read_text().splitlines()


def test_a_crashing_step_prints_one_failed_line(monkeypatch, capsys):
    mod = steps_module()

    def boom() -> str:
        raise RuntimeError("no such field\nsecond line")

    monkeypatch.setitem(mod.STEPS, "kernel", boom)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() extends both for the step it runs
    for key in ("CUDA_DEVICE_MAX_CONNECTIONS", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(key, os.environ.get(key, "1"))
    assert mod.main(["kernel"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "RESULT: FAILED: RuntimeError: no such field"


def test_report_section_is_replaced_in_place(tmp_path):
    mod = steps_module()
    md = tmp_path / "RESULTS.md"
    md.write_text("# Measured results\n\nintro\n\n## vLLM CPU engine\n\nvllm text\n")
    results = {"env": {"device": "NVIDIA H200", "memory_gib": 139.8, "nvidia_smi": "NVIDIA H200, 570.1, 143771 MiB",
                       "python": "3.12.3", "torch": "2.11.0", "cuda": "12.8", "nccl": "2.27.3", "triton": "3.6.0"},
               "bench": {m: {"extra_mib": mib, "seconds": s, "tflops": t, "fwd_seconds": s / 3}
                         for m, mib, s, t in (("bare", 0.0, 0.1, 610.0), ("naive", 30720.0, 0.2, 305.0),
                                              ("triton", 2048.0, 0.19, 430.0))}}
    mod.write_section(md, mod.section_text(results, ["kernel     Triton = reference (40 s)"]))
    first = md.read_text()
    assert first.startswith("# Measured results\n\nintro\n\n## vLLM CPU engine\n\nvllm text\n\n## GPU check")
    assert "NVIDIA H200 (139.8 GiB), driver ['570.1']" not in first and "driver 570.1" in first
    assert "| triton | 2.00 | 190.0 | 430 | 0.70 | 63.3 |" in first and "kernel     Triton = reference" in first
    mod.write_section(md, mod.section_text(results, ["kernel     second run (41 s)"]))
    second = md.read_text()
    assert second.count("## GPU check") == 1 and "second run" in second and "(40 s)" not in second
    md.write_text(second + "\n## Later section\n\nkept\n")
    mod.write_section(md, mod.section_text(results, ["third"]))
    assert md.read_text().endswith("## Later section\n\nkept\n") and "third" in md.read_text()


@pytest.mark.slow
def test_megatron_and_agent_step_bodies_run_on_cpu(tmp_path):
    """The CUDA steps' megatron and LocalAgent code, run on CPU with the reference kernel (API drift
    shows here, not on the lent GPU's clock)."""
    pytest.importorskip("megatron.core")
    code = (f"import sys, torch; sys.path.insert(0, {str(ROOT)!r}); torch.set_num_threads(1)\n"
            f"import importlib.util as u; s = u.spec_from_file_location('g', {str(ROOT / 'benchmarks' / 'gpu_check_steps.py')!r})\n"
            "g = u.module_from_spec(s); s.loader.exec_module(g)\n"
            f"print(g.step_megatron_cpu({str(tmp_path / 'cpu.pt')!r}))\n"
            "import json, gpu_check_megatron as m; d = m.agent_compare('reference', 'megatron')\n"
            "c = m.colocation_memory(hidden=64, layers=1, vocab=256)\n"
            "print(json.dumps({**{k: d[k] for k in ('logp_diff', 'loss_diff', 'grad_norm_rel_diff', 'moved', "
            "'parameters')}, 'offload': {k: c[k] for k in ('identical', 'update_after_wake_finite', 'pinned_when_cuda', "
            "'parked_mib')}}))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    saved, data = res.stdout.strip().splitlines()[-2:]
    data = json.loads(data)
    assert saved == "saved" and (tmp_path / "cpu.pt").stat().st_size > 10_000
    assert data["moved"] == data["parameters"] > 10
    assert data["logp_diff"] < 1e-4 and data["loss_diff"] < 1e-5 and data["grad_norm_rel_diff"] < 1e-4, data
    offload = data["offload"]  # the colocation memory body: wake bit-identical, host buffers unpinned on CPU
    assert offload["identical"] and offload["update_after_wake_finite"] and offload["pinned_when_cuda"], offload
    assert offload["parked_mib"]["all"] > offload["parked_mib"]["optimizer"] > 0, offload
