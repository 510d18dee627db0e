"""exchange stage: tokenizer-neutral trajectories and each learner's re-tokenized view (docs/algorithm.md §3, §6).

``import hacrl_megatron.exchange`` needs only the standard library; tokenizers are loaded lazily
through :func:`load_tokenizer` (transformers + tokenizers).
"""

from hacrl_megatron.exchange.records import FINISH_REASONS, LearnerView, Trajectory
from hacrl_megatron.exchange.retokenize import (
    EOS_MODES,
    Exchange,
    ExchangeStats,
    decode_response,
    encode_text,
)
from hacrl_megatron.exchange.tokenizers import BUILTIN_TOKENIZERS, load_tokenizer, tokenizer_fingerprint

__all__ = [
    "BUILTIN_TOKENIZERS",
    "EOS_MODES",
    "FINISH_REASONS",
    "Exchange",
    "ExchangeStats",
    "LearnerView",
    "Trajectory",
    "decode_response",
    "encode_text",
    "load_tokenizer",
    "tokenizer_fingerprint",
]
