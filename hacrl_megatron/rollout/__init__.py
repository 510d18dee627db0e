"""rollout stage: the RolloutEngine protocol, the HF engine (CPU / tests) and the SGLang client (GPU).

``out = engine.generate(prompt_ids, SamplingParams(n=G, temperature=1.0))`` gives ``out[i][j]``,
sample j of prompt i, as a :class:`Completion` (ids without the ending eos; finish_reason says how
it ended). On GPU, :class:`SGLangServer` launches one server per agent partition and
:class:`SGLangEngine` talks to it. After each optimizer step the trainer calls ``engine.load_weights(hf_named_tensors)``.
"""

from hacrl_megatron.rollout.hf_engine import HFEngine, hf_sequence_logprob
from hacrl_megatron.rollout.sglang_engine import SGLangEngine, SGLangError, SGLangUnreachable
from hacrl_megatron.rollout.sglang_server import SGLangServer, SGLangServerError
from hacrl_megatron.rollout.types import COMPLETION_FINISH_REASONS, Completion, RolloutEngine, SamplingParams

__all__ = [
    "COMPLETION_FINISH_REASONS",
    "Completion",
    "HFEngine",
    "RolloutEngine",
    "SGLangEngine",
    "SGLangError",
    "SGLangServer",
    "SGLangServerError",
    "SGLangUnreachable",
    "SamplingParams",
    "hf_sequence_logprob",
]
