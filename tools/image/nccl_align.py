"""Make the engine virtual environments load the trainer's NCCL (run in the image build; docs/clusters.md).

    python3 tools/image/nccl_align.py [--check] /opt/sglang/bin/python /opt/vllm/bin/python

The trainer runs the base image's torch and NCCL; the SGLang and vLLM venvs bring pip's torch with
its own ``nvidia-nccl-cu*`` wheel. NCCL refuses a communicator whose ranks differ in version, so the
weight-update group between trainer and engines would fail on both sides. For each engine
interpreter given (one that does not exist is skipped):

1. find this interpreter's NCCL: ``torch.cuda.nccl.version()`` and the ``libnccl.so`` file torch
   loaded (``/proc/self/maps``);
2. replace every ``nvidia/nccl/lib/libnccl.so*`` of the engine's site-packages with a link to that
   file, so its torch (and vLLM's and SGLang's own NCCL wrappers, which open ``libnccl.so.2``) load
   the same library; when torch here has NCCL built in (no file to link), install the wheel of the
   same version instead (``pip install --no-deps nvidia-nccl-cu<CUDA major>==<version>``);
3. check: the engine interpreter's ``torch.cuda.nccl.version()`` must now equal this one's.

``--check`` skips step 2. One line per interpreter; exit 1 when a version still differs. Nothing
to do (exit 0) when this torch has no NCCL (a CPU base) or an engine's torch has none (a CPU venv).
The trainer repeats the comparison before every weight-update group (``sync/nccl_version.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# run by the engine interpreter: its torch's NCCL version and where its site-packages are
PROBE = ("import json, site, sysconfig, torch\n"
         "try:\n    v = list(torch.cuda.nccl.version())[:3]\n"
         "except (AttributeError, RuntimeError):\n    v = None\n"
         "dirs = {sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib'], *site.getsitepackages()}\n"
         "print(json.dumps({'nccl': v, 'site': sorted(dirs)}))")


def text(version: list[int] | tuple[int, ...] | None) -> str:
    return "none" if version is None else ".".join(map(str, version))


def trainer_nccl() -> tuple[list[int] | None, Path | None, str | None]:
    """(version, path of the loaded libnccl or None when built in, CUDA version) of this interpreter's torch."""
    import torch

    try:
        version = list(torch.cuda.nccl.version())[:3]
    except (AttributeError, RuntimeError):
        return None, None, torch.version.cuda
    paths = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
             if "libnccl.so" in line and line.split()[-1].startswith("/")}
    return version, (Path(sorted(paths)[0]) if paths else None), torch.version.cuda


def probe(python: str) -> dict:
    """The engine interpreter's answer to :data:`PROBE` ({"nccl": [..] or None, "site": [dirs]})."""
    res = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"{python} could not import torch: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def engine_libraries(site_dirs: list[str]) -> list[Path]:
    """The NCCL library files (and links) of the ``nvidia-nccl-*`` wheel in these site-packages."""
    return sorted({p for d in site_dirs for p in Path(d, "nvidia", "nccl", "lib").glob("libnccl.so*")})


def link_to(files: list[Path], target: Path) -> None:
    """Replace each of ``files`` with a symbolic link to ``target``."""
    for f in files:
        f.unlink()
        f.symlink_to(target)


def pin_wheel(python: str, version: list[int], cuda: str | None) -> None:
    """Install the wheel of the trainer's NCCL version into the engine venv (outside the image's
    constraints file, as the venv's own install was)."""
    wheel = f"nvidia-nccl-cu{(cuda or '12').split('.')[0]}=={text(version)}"
    env = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}
    subprocess.run([python, "-m", "pip", "install", "--no-cache-dir", "--no-deps", wheel], check=True, env=env)


def align(python: str, trainer: tuple[list[int] | None, Path | None, str | None], check_only: bool) -> tuple[bool, str]:
    """(ok, one line) for one engine interpreter."""
    version, library, cuda = trainer
    if not Path(python).exists():
        return True, f"{python}: skipped (not installed)"
    try:
        before = probe(python)
    except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as err:
        return False, f"{python}: cannot read its NCCL ({err})"
    if before["nccl"] is None:
        return True, f"{python}: no NCCL in its torch (CPU build): nothing to align"
    action = "checked"
    if not check_only and before["nccl"] != version:
        files = engine_libraries(before["site"])
        if library is not None and files:
            link_to(files, library)
            action = f"linked {len(files)} file(s) to {library}"
        else:
            pin_wheel(python, version, cuda)
            action = f"installed nvidia-nccl {text(version)}"
    after = probe(python)["nccl"] if action != "checked" else before["nccl"]
    if after != version:
        return False, (f"{python}: NCCL {text(after)} but the trainer's is {text(version)} ({action}); "
                       f"the weight-update group would fail")
    return True, f"{python}: NCCL {text(after)} = trainer's ({action})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; change nothing")
    parser.add_argument("pythons", nargs="+", help="engine interpreters (e.g. /opt/sglang/bin/python)")
    args = parser.parse_args(argv)
    trainer = trainer_nccl()
    if trainer[0] is None:
        print(f"nccl_align: no NCCL in this torch ({sys.executable}, CPU build): nothing to align")
        return 0
    print(f"nccl_align: trainer NCCL {text(trainer[0])} from {trainer[1] or 'torch (built in)'}")
    ok = True
    for python in args.pythons:
        good, line = align(python, trainer, args.check)
        ok &= good
        print(f"nccl_align: {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
