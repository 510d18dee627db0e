"""Write two small HF checkpoints of different families and tokenizers, stand-ins for your own
(built with transformers from a config, nothing downloaded):

- ``OUT/tiny_llama``: ``LlamaForCausalLM`` (4 heads, 4 KV heads, 2 layers) + a character tokenizer;
- ``OUT/tiny_qwen3``: ``Qwen3ForCausalLM`` (QK-norm, 4 heads, 2 KV heads, 2 layers) + a digit-pair BPE.

Each folder is what ``save_pretrained`` writes (config.json, model.safetensors, tokenizer files),
the same layout as a checkpoint from the hub; the weights are random (seeded).

    python examples/bring_your_own_models/make_models.py [OUT]     # default: models
"""

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hacrl_megatron.exchange.tokenizers import load_tokenizer


def write(out: Path, model_cls, config, tokenizer) -> None:
    torch.manual_seed(0)
    model_cls(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out} ({config.architectures[0]}, vocab {config.vocab_size})")


def main(root: Path) -> None:
    common = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, tie_word_embeddings=True, rms_norm_eps=1e-6)
    char, pair = load_tokenizer("char"), load_tokenizer("pair")
    llama = LlamaConfig(vocab_size=len(char), num_key_value_heads=4, architectures=["LlamaForCausalLM"], **common)
    write(root / "tiny_llama", LlamaForCausalLM, llama, char)
    qwen3 = Qwen3Config(vocab_size=len(pair), num_key_value_heads=2, head_dim=16,
                        architectures=["Qwen3ForCausalLM"], **common)
    write(root / "tiny_qwen3", Qwen3ForCausalLM, qwen3, pair)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("models"))
