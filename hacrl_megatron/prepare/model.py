"""``hacrl prepare model HUB_ID``: an HF model snapshot in ``<out>/<name>``, optionally also as a
Megatron checkpoint at a chosen TP/PP (``--convert``, the same code as ``hacrl convert``).

Only what the trainer, ``hacrl eval`` and SGLang read is fetched: ``config.json``, the safetensors
weights and their index, the tokenizer and generation files (``MODEL_FILES``), not PyTorch ``.bin``
duplicates or other formats. The folder name defaults to the repository's last part, the name the
paper presets use (``models/Qwen3-4B``). Gated models (Llama) need ``huggingface-cli login`` first.
"""

from __future__ import annotations

import argparse
import fnmatch
import logging
import os
import re
import shutil
from pathlib import Path

from hacrl_megatron.prepare.hub import HubError, check_hub, mirror_repo, one_line

logger = logging.getLogger(__name__)

MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
               "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")


def _copy_from_mirror(repo: Path, target: Path) -> None:
    for path in sorted(repo.rglob("*")):
        rel = path.relative_to(repo).as_posix()
        if path.is_file() and any(fnmatch.fnmatch(rel, pattern) for pattern in MODEL_FILES):
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / rel)


def _download(repo_id: str, target: Path, revision: str | None) -> None:
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")  # seconds per metadata request (library default 10)
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "60")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("hacrl prepare model needs huggingface_hub: pip install 'hacrl_megatron[hf]'") from exc
    try:
        snapshot_download(repo_id, revision=revision, local_dir=str(target), allow_patterns=list(MODEL_FILES))
    except Exception as err:  # gated, missing, network lost mid-way: one line each
        raise HubError(f"downloading {repo_id} failed: {one_line(err)}") from None


HUB_PART_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")  # the hub's rule for an owner or a repository name
HUB_ID_RE = re.compile(rf"{HUB_PART_RE.pattern}/{HUB_PART_RE.pattern}")


def prepare_model(repo_id: str, out: str | os.PathLike = "models", *, name: str | None = None,
                  revision: str | None = None, mirror: str | os.PathLike | None = None) -> Path:
    """Fetch ``repo_id`` into ``<out>/<name>`` (default name: the repository's last part); returns it.

    Raises :class:`HubError` (one line) when nothing can be fetched or the result has no
    ``config.json`` or no safetensors weights.
    """
    if not isinstance(repo_id, str) or not HUB_ID_RE.fullmatch(repo_id):
        raise HubError(f"model id {repo_id!r}: expected OWNER/NAME as on the hub (each part letters, digits, '.', "
                       "'_' or '-', starting with a letter or digit: never '.' or '..'), e.g. Qwen/Qwen3-4B")
    if name is not None and not HUB_PART_RE.fullmatch(name):
        raise HubError(f"--name {name!r}: a folder name under --out (letters, digits, '.', '_' or '-', starting "
                       "with a letter or digit): it may not leave --out")
    target = Path(out).expanduser() / (name or repo_id.split("/")[1])
    target.mkdir(parents=True, exist_ok=True)
    if mirror is not None:
        _copy_from_mirror(mirror_repo(mirror, repo_id), target)
    else:
        check_hub()
        _download(repo_id, target, revision)
    if not (target / "config.json").is_file():
        raise HubError(f"{repo_id}: no config.json in {target}; is it a transformers model repository?")
    if not any(target.glob("*.safetensors")):
        raise HubError(f"{repo_id}: no *.safetensors weights in {target} (only safetensors are read; convert "
                       "PyTorch .bin weights with transformers' save_pretrained first)")
    logger.info("%s → %s", repo_id, target)
    return target


def convert_to_megatron(hf_dir: Path, out: Path, tp: int, pp: int) -> int:
    """``hacrl convert --from-hf hf_dir --to-megatron out --tp tp --pp pp``; its exit status."""
    from hacrl_megatron.cli_convert import main as convert_main

    args = argparse.Namespace(from_hf=str(hf_dir), from_megatron=None, gguf_file=None, to_megatron=str(out),
                              to_hf=None, tp=tp, pp=pp, ep=1, etp=None, dtype=None, max_shard_gb=2.0)
    return convert_main(args)
