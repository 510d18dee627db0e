"""Write a third tokenizer folder for the three-agent example: the demo's character-level
alphabet plus merges that make the word ``boxed`` one token (the answer format every agent writes).

The three agents then split the same text three ways; ``Q: 37+48=? A: \\boxed{85}`` is
24 tokens for ``char``, 21 for ``pair`` (digit pairs) and 20 for this one. Any tokenizer folder that
``transformers.AutoTokenizer`` loads, with an eos token, works the same way (``agents.N.tokenizer: DIR``).

    python examples/three_agents/make_tokenizer.py [OUT_DIR]    # default: examples/three_agents/boxed_tokenizer
"""

import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hacrl_megatron.exchange.tokenizers import EOS_TOKEN, PAD_TOKEN, builtin_vocab


def build() -> PreTrainedTokenizerFast:
    vocab, merges = builtin_vocab("char")  # <eos>, <pad>, tab, newline, printable ASCII
    word = "boxed"
    for end in range(2, len(word) + 1):  # b+o, bo+x, box+e, boxe+d
        merges.append((word[: end - 1], word[end - 1]))
        vocab[word[:end]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("boxed_tokenizer")
    build().save_pretrained(out)
    print(f"wrote {out}")
