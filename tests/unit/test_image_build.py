"""The real image build without a Docker engine: tools/image/smoke_build.sh builds the top-level
Dockerfile with Debian's buildah on a local CPU base (mmdebstrap + the CPU torch wheel) and runs
`hacrl --help` and a 2-step `hacrl train --preset cpu_demo` inside it (slow: ~17 min on 2 shared cores;
.ci/run installs buildah and mmdebstrap before its slow step)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "image" / "smoke_build.sh"


def missing_requirement() -> str | None:
    for tool in ("buildah", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install -y buildah mmdebstrap; .ci/run does it as root)"
    if os.geteuid() != 0:
        return "needs root (buildah with chroot isolation and mmdebstrap build root filesystems)"
    return None


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_image_builds_and_runs_the_cpu_demo(tmp_path, capsys):
    reason = missing_requirement()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "HACRL_SMOKE_WORK": str(tmp_path / "work")}
    env.pop("HACRL_SMOKE_KEEP", None)
    env.pop("HACRL_SMOKE_REUSE_BASE", None)
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=3500)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "smoke_build: OK" in res.stdout
    assert "usage: hacrl" in res.stdout  # `hacrl --help` through the entrypoint
    assert "sglang venv /opt/sglang user 1000" in res.stdout  # the venv and the non-root user
    with capsys.disabled():  # the build times and image size belong in the CI log
        print("\n" + "\n".join(line for line in res.stdout.splitlines() if line.startswith("smoke_build:")))
