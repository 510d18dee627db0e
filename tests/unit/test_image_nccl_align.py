"""tools/image/nccl_align.py: the image's engine venvs load the trainer's NCCL, and the build checks it.

No GPU and no engine venv here: the engine interpreter is a stand-in that answers the script's probe
with a site-packages folder holding a ``nvidia/nccl/lib/libnccl.so.2`` file, and reports the
trainer's version once that file links to the trainer's library (as a real torch would, loading the
file it links to), its own wheel's version before.
"""

from __future__ import annotations

import importlib.util
import json
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "image" / "nccl_align.py"


def load():
    spec = importlib.util.spec_from_file_location("nccl_align", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


align_mod = load()


@pytest.fixture
def venv(tmp_path):
    """(engine interpreter stand-in, its libnccl file, the trainer's library, trainer tuple)."""
    site = tmp_path / "venv" / "site-packages"
    lib = site / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"wheel's NCCL 2.26.2")
    trainer_lib = tmp_path / "base" / "libnccl.so.2.27.3"
    trainer_lib.parent.mkdir()
    trainer_lib.write_bytes(b"base's NCCL 2.27.3")
    python = tmp_path / "venv" / "python"
    answer = {"site": [str(site)]}
    python.write_text(
        "#!/bin/sh\n"
        f"if [ -L '{lib}' ]; then v='[2, 27, 3]'; else v='[2, 26, 2]'; fi\n"
        f"echo '{json.dumps(answer)}' | sed \"s/^{{/{{\\\"nccl\\\": $v, /\"\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return python, lib, trainer_lib, ([2, 27, 3], trainer_lib, "12.8")


def test_stand_in_answers_like_the_probe(venv):
    python, lib, _, _ = venv
    answer = align_mod.probe(str(python))
    assert answer["nccl"] == [2, 26, 2] and align_mod.engine_libraries(answer["site"]) == [lib]


def test_links_the_venv_library_to_the_trainers_and_checks(venv):
    python, lib, trainer_lib, trainer = venv
    ok, line = align_mod.align(str(python), trainer, check_only=False)
    assert ok, line
    assert lib.is_symlink() and lib.resolve() == trainer_lib.resolve()
    assert "NCCL 2.27.3 = trainer's" in line and "linked 1 file(s)" in line
    ok, line = align_mod.align(str(python), trainer, check_only=True)  # a second run: nothing to do
    assert ok and "(checked)" in line


def test_check_only_reports_a_mismatch_and_changes_nothing(venv):
    python, lib, _, trainer = venv
    ok, line = align_mod.align(str(python), trainer, check_only=True)
    assert not ok and "NCCL 2.26.2 but the trainer's is 2.27.3" in line
    assert not lib.is_symlink() and lib.read_bytes() == b"wheel's NCCL 2.26.2"


def test_a_link_that_does_not_fix_it_fails(venv, tmp_path):
    python, lib, _, _ = venv
    ok, line = align_mod.align(str(python), ([2, 28, 0], tmp_path / "base" / "libnccl.so.2.27.3", "12.8"), False)
    assert not ok and "NCCL 2.27.3 but the trainer's is 2.28.0" in line  # the stand-in's link gives 2.27.3


def test_missing_cpu_and_broken_interpreters(tmp_path, venv):
    trainer = venv[3]
    assert align_mod.align(str(tmp_path / "absent"), trainer, False) == (True, f"{tmp_path / 'absent'}: skipped "
                                                                           "(not installed)")
    cpu = tmp_path / "cpu_python"
    cpu.write_text("#!/bin/sh\necho '{\"nccl\": null, \"site\": []}'\n")
    cpu.chmod(0o755)
    ok, line = align_mod.align(str(cpu), trainer, False)
    assert ok and "nothing to align" in line
    broken = tmp_path / "broken_python"
    broken.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named torch' >&2\nexit 1\n")
    broken.chmod(0o755)
    ok, line = align_mod.align(str(broken), trainer, False)
    assert not ok and "No module named torch" in line


def test_cpu_trainer_has_nothing_to_align(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--check", str(tmp_path / "no_venv")], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "no NCCL in this torch" in res.stdout


def test_dockerfile_aligns_every_engine_venv_and_the_checks_run_it():
    text = (ROOT / "Dockerfile").read_text()
    copy = text.index("COPY tools/image/nccl_align.py /usr/local/lib/hacrl/nccl_align.py")
    for venv in ("sglang", "vllm"):
        call = f"python3 /usr/local/lib/hacrl/nccl_align.py /opt/{venv}/bin/python"
        assert call in text and text.index(call) > copy
        install = re.search(rf'/opt/{venv}/bin/python -m pip install --no-cache-dir "\$\{{\w+_REQUIREMENT\}}"', text)
        assert install and install.start() < text.index(call)  # after the venv got its torch
    assert "nccl_align.py --check" in (ROOT / "tools" / "image" / "smoke_build.sh").read_text()
    assert "nccl_align.py --check" in (ROOT / "tools" / "image" / "gpu_site_check.sh").read_text()
