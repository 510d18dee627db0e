"""The prompt record that crosses from data/ to rollout/, reward/ and eval/ (frozen, like every record that crosses a stage)."""

from __future__ import annotations

from dataclasses import dataclass

from hacrl_megatron.reward.verify import KINDS


@dataclass(frozen=True)
class PromptRecord:
    """One verifiable prompt.

    Attributes:
        id: stable unique id, e.g. ``"addition-d2-s1234-train-17"`` or ``"math500-test/precalculus/807.json"``.
        question: the problem text, without any chat template (see ``data.prompts.format_prompt``).
        answer: the reference the verifier checks against; its meaning depends on ``kind``.
        source: the task or dataset name (``"addition"``, ``"math500"``, ...), used in metrics.
        kind: how the verifier checks (``reward.verify.KINDS``): ``"math"`` — last ``\\boxed{}`` vs a
            LaTeX answer after MATH normalisation; ``"integer"`` — an integer answer;
            ``"countdown"`` — ``answer`` is ``"target|n1,n2,..."`` (``reward.countdown``).
        extra: a verl row's ``extra_info`` as JSON text ("" for every other record), handed to a
            verl-style ``data.checker`` with ``source`` as its ``data_source``.
    """

    id: str
    question: str
    answer: str
    source: str
    kind: str
    extra: str = ""

    def __post_init__(self) -> None:
        for name in ("id", "question", "answer", "source", "kind", "extra"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"PromptRecord.{name} must be str, got {type(value).__name__}: {value!r}")
        if self.kind not in KINDS:
            raise ValueError(f"PromptRecord.kind={self.kind!r} is not one of {KINDS} (id={self.id!r})")
        if not self.question.strip():
            raise ValueError(f"PromptRecord.question is empty (id={self.id!r})")
        if not self.answer.strip():
            raise ValueError(f"PromptRecord.answer is empty (id={self.id!r})")
