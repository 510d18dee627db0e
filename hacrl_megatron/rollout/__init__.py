"""rollout stage: engine clients (the HF engine on CPU / tests, SGLang servers on GPU), the pool that
drives an agent's clients, and the seam the weight transports of ``sync/`` meet them at.

``out = engine.generate(prompt_ids, SamplingParams(n=G, temperature=1.0))`` gives ``out[i][j]``,
sample j of prompt i, as a :class:`Completion` (ids without the ending eos; finish_reason says how
it ended). ``rollout/protocol.py`` says what an engine client is (:class:`EngineClient`) and which
weight-update operations each transport calls on it; ``rollout/launch.py`` starts an agent's clients
for ``rollout.engine`` (one module per engine: ``hf_engine``, ``sglang_engine`` + ``sglang_server``);
:class:`EnginePool` drives all clients of an agent (balanced generation, restarts, weight sync
through a transport). After each optimizer step the trainer calls
``engine.sync_from(agent.export_hf_weights)``.
"""

from hacrl_megatron.rollout.engine_pool import EnginePool
from hacrl_megatron.rollout.hf_engine import HFEngine, hf_sequence_logprob
from hacrl_megatron.rollout.launch import ENGINE_MODULES, engine_root, start_engines
from hacrl_megatron.rollout.protocol import (
    BroadcastWeightLoader,
    DiskWeightLoader,
    EngineClient,
    EngineError,
    EngineUnreachable,
    StartedEngines,
    TensorWeightLoader,
    WeightTransport,
)
from hacrl_megatron.rollout.sglang_engine import SGLangEngine, SGLangError, SGLangUnreachable
from hacrl_megatron.rollout.sglang_server import SGLangServer, SGLangServerError
from hacrl_megatron.rollout.types import (
    COMPLETION_FINISH_REASONS,
    Completion,
    RolloutEngine,
    SamplingParams,
    TrainingEngine,
    sample_seeds,
)

__all__ = [
    "COMPLETION_FINISH_REASONS",
    "ENGINE_MODULES",
    "BroadcastWeightLoader",
    "Completion",
    "DiskWeightLoader",
    "EngineClient",
    "EngineError",
    "EnginePool",
    "EngineUnreachable",
    "HFEngine",
    "RolloutEngine",
    "SGLangEngine",
    "SGLangError",
    "SGLangServer",
    "SGLangServerError",
    "SGLangUnreachable",
    "SamplingParams",
    "StartedEngines",
    "TensorWeightLoader",
    "TrainingEngine",
    "WeightTransport",
    "engine_root",
    "hf_sequence_logprob",
    "sample_seeds",
    "start_engines",
]
