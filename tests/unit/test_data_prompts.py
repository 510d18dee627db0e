"""Per-agent prompt formatting: the tokenizer's chat template when it has one, a short plain one else."""

from __future__ import annotations

import pytest

from hacrl_megatron.data import CHAT_INSTRUCTION, format_prompt

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tokenizer(chat_template: str | None):
    """A real HF fast tokenizer (word-level, built in memory) with or without a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"[UNK]": 0, "<eos>": 1}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="[UNK]")
    tok.chat_template = chat_template
    return tok


def test_plain_template_is_short():
    assert format_prompt("37+48=?") == "Q: 37+48=? A: "
    assert format_prompt("37+48=?", _tokenizer(None)) == "Q: 37+48=? A: "
    assert format_prompt("37+48=?", _tokenizer(CHAT_TEMPLATE), template="plain") == "Q: 37+48=? A: "


def test_chat_template_used_when_present():
    tok = _tokenizer(CHAT_TEMPLATE)
    expected = "<|user|>37+48=?\nPut the final answer in \\boxed{}.<eos><|assistant|>"
    assert format_prompt("37+48=?", tok) == expected
    assert format_prompt("37+48=?", tok, template="chat") == expected
    assert CHAT_INSTRUCTION in expected


def test_custom_template_and_errors():
    assert format_prompt("1+1=?", template="Problem: {question}\nAnswer:") == "Problem: 1+1=?\nAnswer:"
    with pytest.raises(ValueError, match="needs a tokenizer with a chat_template"):
        format_prompt("1+1=?", _tokenizer(None), template="chat")
    with pytest.raises(ValueError, match="must be one of"):
        format_prompt("1+1=?", template="fancy")
    with pytest.raises(ValueError, match="non-empty str"):
        format_prompt("   ")
