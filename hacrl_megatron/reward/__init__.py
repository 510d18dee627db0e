"""reward stage: the shared verifiable reward R(y) ∈ [0, 1] (docs/algorithm.md §2, §9).

Each response is verified once; the score is shared by every learner. Public API:

- :class:`RewardRequest` (kind, response, reference) and :func:`score_request` (in-process);
- :class:`VerifierPool` — worker processes with a per-item timeout, for training and evaluation;
- answer utilities: :func:`last_boxed_answer`, :func:`normalize_answer`, :func:`is_equiv`;
- checkers per kind: :func:`check_math`, :func:`check_integer`, :func:`check_countdown`.
"""

from hacrl_megatron.reward.countdown import (
    check_countdown,
    encode_countdown_reference,
    parse_countdown_reference,
)
from hacrl_megatron.reward.extract import last_boxed_answer
from hacrl_megatron.reward.normalize import is_equiv, normalize_answer
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.reward.verify import (
    KINDS,
    MODES,
    PathologicalInputError,
    RewardRequest,
    check_integer,
    check_math,
    score_request,
)

__all__ = [
    "KINDS",
    "MODES",
    "PathologicalInputError",
    "RewardRequest",
    "VerifierPool",
    "check_countdown",
    "check_integer",
    "check_math",
    "encode_countdown_reference",
    "is_equiv",
    "last_boxed_answer",
    "normalize_answer",
    "parse_countdown_reference",
    "score_request",
]
