"""Under a TMPDIR too long for Unix sockets (107 bytes), multiprocessing's and Ray's sockets go to a short
system folder, and a CPU tensor still crosses processes by file descriptor (the tensor weight sync)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hacrl_megatron import sockets

ROOT = Path(__file__).resolve().parents[2]


def _long_dir(tmp_path: Path) -> Path:
    folder = tmp_path / ("a folder with spaces " * 6).strip() / ("x" * 60)
    folder.mkdir(parents=True)
    return folder


def test_short_base_is_the_temp_dir_when_it_fits(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", "/tmp")
    assert sockets.short_temp_base(sockets.PYMP_SOCKET_CHARS) == "/tmp"
    assert sockets.ray_temp_dir() is None or os.environ.get("RAY_TMPDIR")


def test_a_long_temp_dir_is_replaced_for_sockets_only(monkeypatch, tmp_path):
    long_dir = str(_long_dir(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", long_dir)
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    base = sockets.short_temp_base(sockets.PYMP_SOCKET_CHARS)
    assert base in sockets.SHORT_TEMP_DIRS and sockets.fits(base, sockets.PYMP_SOCKET_CHARS)
    ray_dir = sockets.ray_temp_dir()
    assert ray_dir == os.path.join(sockets.short_temp_base(sockets.RAY_SOCKET_CHARS + 15), f"ray-{os.getuid()}")
    assert tempfile.gettempdir() == long_dir  # everything else keeps TMPDIR


def test_a_cpu_tensor_crosses_processes_under_a_long_tmpdir(tmp_path):
    """The sender's socket (multiprocessing's resource sharer) lives in its per-process folder: with a
    TMPDIR of ~200 bytes this failed with 'AF_UNIX path too long' before the folder was made short."""
    long_dir = _long_dir(tmp_path)
    assert len(os.fsencode(str(long_dir))) > sockets.AF_UNIX_PATH_MAX - sockets.PYMP_SOCKET_CHARS
    code = (
        "import torch\n"
        "from hacrl_megatron.sync.cuda_ipc import dumps_named_tensors, loads_named_tensors\n"
        "from hacrl_megatron.sockets import use_short_multiprocessing_dir\n"
        "t = torch.arange(6, dtype=torch.float32)\n"
        "payload = dumps_named_tensors([('w', t)])  # shares the storage's fd through a Unix socket\n"
        "assert len(use_short_multiprocessing_dir()) < 60\n"
        "(name, back), = loads_named_tensors(payload)\n"
        "print((name, back.tolist()))\n")
    env = {**os.environ, "TMPDIR": str(long_dir)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "('w', [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])"
