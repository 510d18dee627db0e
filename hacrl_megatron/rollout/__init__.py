"""rollout stage: the RolloutEngine protocol, the HF engine (CPU / tests) and the SGLang client (GPU).

``out = engine.generate(prompt_ids, SamplingParams(n=G, temperature=1.0))`` gives ``out[i][j]``,
sample j of prompt i, as a :class:`Completion` (ids without the ending eos; finish_reason says how
it ended). On GPU, :class:`SGLangServer` launches a server per engine, :class:`SGLangEngine` talks to
one, and :class:`EnginePool` drives all engines of an agent (balanced generation, restarts, weight
sync through a transport of ``sync/``). After each optimizer step the trainer calls
``engine.sync_from(agent.export_hf_weights)``.
"""

from hacrl_megatron.rollout.engine_pool import EnginePool
from hacrl_megatron.rollout.hf_engine import HFEngine, hf_sequence_logprob
from hacrl_megatron.rollout.sglang_engine import SGLangEngine, SGLangError, SGLangUnreachable
from hacrl_megatron.rollout.sglang_server import SGLangServer, SGLangServerError
from hacrl_megatron.rollout.types import (
    COMPLETION_FINISH_REASONS,
    Completion,
    RolloutEngine,
    SamplingParams,
    TrainingEngine,
)

__all__ = [
    "COMPLETION_FINISH_REASONS",
    "Completion",
    "EnginePool",
    "HFEngine",
    "RolloutEngine",
    "SGLangEngine",
    "SGLangError",
    "SGLangServer",
    "SGLangServerError",
    "SGLangUnreachable",
    "SamplingParams",
    "TrainingEngine",
    "hf_sequence_logprob",
]
