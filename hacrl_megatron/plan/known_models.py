"""HF ``config.json`` contents of the models the presets and docs name, for planning before the
weights are downloaded: when a preset's ``model.hf_path`` folder is absent, the planner uses the
entry whose name is the folder's last component (and says so in its output).

Only architecture fields are kept; the values are those published with each model.
"""

from __future__ import annotations

_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                "rope_type": "llama3"}


def _llama(hidden: int, layers: int, heads: int, ffn: int, factor: float, tie: bool) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": factor},
            "tie_word_embeddings": tie, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def _qwen3(hidden: int, layers: int, heads: int, ffn: int, tie: bool, max_pos: int = 40960,
           theta: float = 1000000.0) -> dict:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": hidden,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": max_pos,
            "rms_norm_eps": 1e-6, "rope_theta": theta, "tie_word_embeddings": tie, "hidden_act": "silu",
            "attention_bias": False, "torch_dtype": "bfloat16"}


_QWEN25_72B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 8192,
               "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
               "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
               "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
               "use_sliding_window": False, "torch_dtype": "bfloat16"}

def _qwen3_moe(hidden: int, layers: int, heads: int, ffn: int, moe_ffn: int, max_pos: int = 40960) -> dict:
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": hidden,
            "intermediate_size": ffn, "moe_intermediate_size": moe_ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "vocab_size": 151936, "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16"}


_MIXTRAL_8X7B = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
                 "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                 "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
                 "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}

KNOWN_CONFIGS: dict[str, dict] = {
    "Llama-3.2-3B": _llama(3072, 28, 24, 8192, 32.0, True),
    "Llama-3.2-3B-Instruct": _llama(3072, 28, 24, 8192, 32.0, True),
    "Llama-3.1-8B": _llama(4096, 32, 32, 14336, 8.0, False),
    "Llama-3.1-8B-Instruct": _llama(4096, 32, 32, 14336, 8.0, False),
    "Llama-3.1-70B": _llama(8192, 80, 64, 28672, 8.0, False),
    "Llama-3.1-70B-Instruct": _llama(8192, 80, 64, 28672, 8.0, False),
    "Llama-3.3-70B-Instruct": _llama(8192, 80, 64, 28672, 8.0, False),
    "Llama-3.1-405B": _llama(16384, 126, 128, 53248, 8.0, False),
    "Llama-3.1-405B-Instruct": _llama(16384, 126, 128, 53248, 8.0, False),
    "Qwen2.5-72B": _QWEN25_72B,
    "Qwen2.5-72B-Instruct": _QWEN25_72B,
    "Qwen3-1.7B": _qwen3(2048, 28, 16, 6144, True),
    "Qwen3-1.7B-Base": _qwen3(2048, 28, 16, 6144, True, max_pos=32768),
    "Qwen3-4B": _qwen3(2560, 36, 32, 9728, True),
    "Qwen3-4B-Base": _qwen3(2560, 36, 32, 9728, True, max_pos=32768),
    "Qwen3-4B-Instruct-2507": _qwen3(2560, 36, 32, 9728, True, max_pos=262144, theta=5000000.0),
    "Qwen3-32B": _qwen3(5120, 64, 64, 25600, False),
    "Qwen3-30B-A3B": _qwen3_moe(2048, 48, 32, 6144, 768),
    "Qwen3-235B-A22B": _qwen3_moe(4096, 94, 64, 12288, 1536),
    "Mixtral-8x7B-Instruct-v0.1": _MIXTRAL_8X7B,
}
