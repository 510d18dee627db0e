"""The shared verifiable reward R(y) ∈ [0, 1] (docs/algorithm.md §2, §9): one request, one score.

Every response is verified once and its reward is shared by every learner (docs/algorithm.md §2), so the API
takes a batch of :class:`RewardRequest` (kind, response, reference) and returns one float each.

Kinds (the ``kind`` field of a :class:`~hacrl_megatron.data.records.PromptRecord`):

- ``"math"``: the last ``\\boxed{}`` of the response against the reference answer. Mode ``"math"``
  is the paper's MATH-style normalised exact match (:mod:`.normalize`); mode ``"math_verify"``
  scores 1 when either that match or math-verify's symbolic check (:mod:`.math_verify_backend`)
  accepts, so it never rejects what the paper's reward accepts.
- ``"integer"``: the last ``\\boxed{}`` (or, without one, a response that is just a number, e.g.
  ``" 85"``) equal to the integer reference after the same normalisation (``x=85``, ``85.0``, ``85.``).
- ``"countdown"``: :func:`~hacrl_megatron.reward.countdown.check_countdown`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hacrl_megatron.reward.countdown import check_countdown
from hacrl_megatron.reward.extract import last_boxed_answer
from hacrl_megatron.reward.math_verify_backend import looks_explosive, math_verify_verdict
from hacrl_megatron.reward.normalize import is_equiv

KINDS = ("math", "integer", "countdown")
MODES = ("math", "math_verify")
MAX_RESPONSE_CHARS = 1_000_000  # ~250k tokens: far beyond any max_response_len we run
_BARE_NUMBER_RE = re.compile(r"^[-+]?\d[\d,]*(?:\.\d+)?\.?$")


class PathologicalInputError(ValueError):
    """A response too large or malformed to score safely; it scores 0 and is counted."""


@dataclass(frozen=True)
class RewardRequest:
    """One response to verify.

    Attributes:
        kind: how to check, one of ``KINDS`` (from the prompt record).
        response: the generated response text (decoded, special tokens skipped).
        reference: the record's ``answer`` field (a math answer, an integer, or a countdown
            ``"target|n1,n2,..."`` string).
        source: the record's ``source`` (a verl row's ``data_source``), for a verl-style checker.
        extra: the record's ``extra`` (a verl row's ``extra_info`` as JSON text, "" without), likewise.
    """

    kind: str
    response: str
    reference: str
    source: str = ""
    extra: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"RewardRequest.kind={self.kind!r} is not one of {KINDS}")
        for name in ("response", "reference", "source", "extra"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"RewardRequest.{name} must be str, got {type(value).__name__}")


def check_math(response: str, reference: str) -> float:
    """Paper reward: 1.0 when the last boxed answer equals the reference after normalisation."""
    return 1.0 if is_equiv(last_boxed_answer(response), reference) else 0.0


def check_integer(response: str, reference: str) -> float:
    """1.0 when the final answer (boxed, or a bare-number response) equals the integer reference."""
    answer = last_boxed_answer(response)
    if answer is None:
        bare = response.strip()
        if not _BARE_NUMBER_RE.match(bare):
            return 0.0
        answer = bare
    return 1.0 if is_equiv(answer, reference) else 0.0


def score_request_with_event(
    request: RewardRequest, mode: str = "math", math_verify_timeout_s: float = 5.0
) -> tuple[float, str | None]:
    """Score one request, with an event: ``"guarded"`` when a safety screen changed how it was
    scored, ``"timeout"`` when math-verify's own time limit stopped its check (the score is then the
    exact match alone), else None.

    ``math_verify_timeout_s`` is math-verify's own limit per parse/verify call (main thread only).
    Raises PathologicalInputError for responses over ``MAX_RESPONSE_CHARS``.
    """
    if mode not in MODES:
        raise ValueError(f"reward mode {mode!r} is not one of {MODES}")
    if len(request.response) > MAX_RESPONSE_CHARS:
        raise PathologicalInputError(
            f"response has {len(request.response)} characters, more than MAX_RESPONSE_CHARS={MAX_RESPONSE_CHARS}"
        )
    if request.kind == "countdown":
        return check_countdown(request.response, request.reference), None
    if request.kind == "integer":
        return check_integer(request.response, request.reference), None
    exact = check_math(request.response, request.reference)
    if mode == "math" or exact == 1.0:
        return exact, None
    boxed = last_boxed_answer(request.response)
    # Screen what math-verify would read: the boxed answer when there is one, else the whole text.
    if looks_explosive(boxed if boxed is not None else request.response) or looks_explosive(
        request.reference
    ):
        return exact, "guarded"
    text = "\\boxed{" + boxed + "}" if boxed is not None else request.response
    equal, timed_out = math_verify_verdict(text, request.reference, math_verify_timeout_s)
    if equal:
        return 1.0, None
    return exact, ("timeout" if timed_out else None)  # math-verify's own alarm fired: counted as a timeout


def score_request(request: RewardRequest, mode: str = "math") -> float:
    """R(y) ∈ [0, 1] for one request (in the calling process; no time limit beyond the guards)."""
    return score_request_with_event(request, mode)[0]
