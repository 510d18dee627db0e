"""Where a step's rollout comes from: now, one step ahead, or continuously (docs/algorithm.md §7b).

A :class:`RolloutRecord` is one batch of every agent's responses: the prompts, the completions,
and the weight version of each agent that sampled them (version v = the weights at the start of
training step v). The learner loop takes one record per step from a source:

* :class:`SyncSource` (``train.rollout_mode=sync``): generates the step's batch when asked, with
  the step's own weights (staleness 0): the synchronous loop exactly.
* :class:`OneStepOffSource` (``one_step_off``): right after handing out step t's batch it starts
  step t + 1's in a thread, with the weights step t started from, so it overlaps step t's
  verification, π_old passes and training. The weight push after step t waits for that batch and
  then runs between two generate calls. Every batch but the first is exactly one version behind.
* :class:`AsyncSource` (``async``, ``train.max_staleness`` = K): a thread generates batch after
  batch with whatever weights the engines hold, keeping at most K finished batches queued; the loop
  takes the oldest, and drops (and counts) any whose weights are more than K versions behind.

Engines are shared between the producer thread and the loop (weight push, post-sync check,
evaluation): :meth:`RolloutSource.engines_idle` holds the producer between two generate calls. The
hand-over is fair (:class:`EngineTurns`): once the loop asks, the producer starts no new generate
call, so the loop has the engines as soon as the one in flight ends, never after two or more. The
time the loop waits for the source (the batch it trains on, the batch in flight before a push, the
generate call in flight) is ``stats.wait_s``, the step's ``rollout/wait_s``. With ``end`` (the run's
``train.steps``) no batch at or past it is generated: the run's end stops the producer.

Checkpoints with work in flight: batches that finished but were not trained on yet are saved with
the checkpoint (their behaviour log-probs filled in first); a batch still being generated is
dropped and generated again after a resume, from the same seeds and weights. The finished batches
and the producer's position are read together (:meth:`RolloutSource.snapshot`), so a batch that
finishes while the checkpoint is written is either saved or regenerated, never lost. A one-step-off run
therefore resumes exactly as it would have continued; an asynchronous one resumes with its saved
queue, but which weights sample which batch depends on timing there, so it is not bit-reproducible.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from hacrl_megatron.data.records import PromptRecord
from hacrl_megatron.rollout.types import Completion

Generate = Callable[[int, list[PromptRecord]], dict[str, list[list[Completion]]]]  # (batch index, prompts)


@dataclass(frozen=True)
class RolloutRecord:
    """One batch of responses from every agent.

    index: the batch's position in the run (its prompts start at ``index × train.prompts_per_step``;
        the step it trains in one_step_off and sync modes).
    versions: agent name → the weight version that sampled its responses.
    prompts: the P prompts. completions: agent name → [P][G] completions.
    behaviour: agent name → [P·G] Σ log π_behav of its own responses under ``versions[name]``, filled in
        by the loop when the batch trains with newer weights (None: not needed or not computed yet).
    """

    index: int
    versions: dict[str, int]
    prompts: list[PromptRecord]
    completions: dict[str, list[list[Completion]]]
    behaviour: dict[str, list[float]] | None = None

    def staleness(self, version: int) -> int:
        """How many versions the oldest agent's sampling weights lag behind ``version``."""
        return max(version - v for v in self.versions.values())

    def to_state(self) -> dict[str, Any]:
        """Plain values only (checkpoints load with ``weights_only=True``)."""
        return {"index": self.index, "versions": dict(self.versions),
                "prompts": [[p.id, p.question, p.answer, p.source, p.kind, p.extra] for p in self.prompts],
                "completions": {name: [[[list(c.token_ids), c.text, c.finish_reason] for c in group] for group in groups]
                                for name, groups in self.completions.items()},
                "behaviour": self.behaviour}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RolloutRecord:
        prompts = [PromptRecord(*p) for p in state["prompts"]]  # id, question, answer, source, kind[, extra]
        completions = {name: [[Completion(token_ids=tuple(ids), text=text, finish_reason=reason)
                               for ids, text, reason in group] for group in groups]
                       for name, groups in state["completions"].items()}
        return cls(int(state["index"]), {k: int(v) for k, v in state["versions"].items()}, prompts, completions,
                   state.get("behaviour"))


@dataclass
class SourceStats:
    """Counters of a source (reported per step)."""

    dropped: int = 0  # batches too stale to train on (async)
    wait_s: float = 0.0  # seconds the loop waited for the source since the step's batch was asked for


class EngineTurns:
    """The engines, shared by the producer (one generate call per turn) and the loop (a weight push,
    the post-sync check, an evaluation), with the loop first: while the loop waits, the producer
    starts no new turn, so the loop waits for at most the generate call in flight. A plain lock gives
    no such order: the producer re-took it for batch after batch while the push waited."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._loop_waiting = 0

    @contextlib.contextmanager
    def producer(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._busy and not self._loop_waiting)
            self._busy = True
        try:
            yield
        finally:
            self._release()

    @contextlib.contextmanager
    def loop(self) -> Iterator[float]:
        """Yields the seconds the loop waited for the turn."""
        start = time.perf_counter()
        with self._cond:
            self._loop_waiting += 1
            try:
                self._cond.wait_for(lambda: not self._busy)
            finally:
                self._loop_waiting -= 1
            self._busy = True
        try:
            yield time.perf_counter() - start
        finally:
            self._release()

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


class RolloutSource:
    """A source of rollout records for the learner loop (this class: the synchronous one).

    sample: ``sample(index) -> prompts`` of batch ``index``. generate: ``generate(index, prompts)`` →
    completions (every agent, the loop's ``stages.rollout``). version: the engines' weight version now.
    end: the first batch index never to generate (the run's ``train.steps``; None: no end).
    concurrent: generate in a thread of its own. False where an engine computes in this process (the
    HF engine): its seeded sampling draws from torch's process-wide RNG, which megatron-core's RNG
    tracker saves and restores around the trainer's forward passes, so the two must not interleave;
    the producer then generates in the loop's thread at the same points, with the same weights (the
    batches and their staleness are the same, only nothing overlaps).
    """

    def __init__(self, sample: Callable[[int], list[PromptRecord]], generate: Generate,
                 version: Callable[[], dict[str, int]], concurrent: bool = True, end: int | None = None) -> None:
        self._sample, self._generate, self._version = sample, generate, version
        self.concurrent = concurrent
        self.end = end
        self.stats = SourceStats()
        self._engines = EngineTurns()  # whoever uses the engines: a generate call, or the loop (first)

    def _produce(self, index: int) -> RolloutRecord:
        prompts = self._sample(index)
        with self._engines.producer():
            versions = self._version()
            completions = self._generate(index, prompts)
        return RolloutRecord(index, versions, prompts, completions)

    def _generates(self, index: int) -> bool:
        """Whether batch ``index`` is before the run's end."""
        return self.end is None or index < self.end

    def next(self, step: int) -> RolloutRecord:
        """The batch step ``step`` trains on (blocks until it is there)."""
        self.stats.wait_s = 0.0
        return self._produce(step)

    @contextlib.contextmanager
    def engines_idle(self) -> Iterator[None]:
        """The engines are the caller's inside the block (no generate call runs meanwhile); the wait for
        the generate call in flight counts in ``stats.wait_s``."""
        with self._engines.loop() as waited:
            self.stats.wait_s += waited
            yield

    def finish_in_flight(self) -> None:
        """Wait for generation that must use the current weights before they change (one_step_off)."""

    def pending(self) -> list[RolloutRecord]:
        """Finished batches not handed out yet (saved with a checkpoint)."""
        return self.snapshot()[0]

    def snapshot(self) -> tuple[list[RolloutRecord], int | None]:
        """The finished batches not handed out yet and :meth:`next_index`, read at one instant."""
        return [], None

    def restore(self, records: list[RolloutRecord], next_index: int) -> None:
        """Continue from a checkpoint: ``records`` first, then new batches from ``next_index``."""
        if records:
            raise ValueError("train.rollout_mode=sync keeps no batches between steps; the checkpoint holds "
                             f"{len(records)} (written by an overlapping run: resume it with its rollout_mode)")

    def replace_pending(self, records: list[RolloutRecord]) -> None:
        """Swap the queued records for updated copies (behaviour log-probs filled in), same order."""

    def next_index(self) -> int | None:
        """The batch a resumed producer starts from, or None: the loop's step (sync, one_step_off)."""
        return None

    def close(self) -> None:
        """Stop the producer thread, if any."""


SyncSource = RolloutSource


class OneStepOffSource(RolloutSource):
    """Step t + 1's batch is generated while step t trains, with the weights step t started from."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ready: RolloutRecord | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _prefetch(self, index: int) -> None:
        if not self.concurrent:
            self._ready = self._produce(index)
            return

        def work() -> None:
            try:
                self._ready = self._produce(index)
            except BaseException as err:  # noqa: BLE001 - re-raised in the loop's thread
                self._error = err

        self._thread = threading.Thread(target=work, name="hacrl-rollout", daemon=True)
        self._thread.start()

    def finish_in_flight(self) -> None:
        if self._thread is not None:
            start = time.perf_counter()
            self._thread.join()
            self._thread = None
            self.stats.wait_s += time.perf_counter() - start
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def next(self, step: int) -> RolloutRecord:
        start = time.perf_counter()
        self.stats.wait_s = 0.0
        self.finish_in_flight()
        record, self._ready = self._ready, None
        if record is None or record.index != step:
            record = self._produce(step)  # the first step, or the first after a resume without a saved batch
        self.stats.wait_s = time.perf_counter() - start
        if self._generates(step + 1):  # the last step prefetches nothing
            self._prefetch(step + 1)
        return record

    def snapshot(self) -> tuple[list[RolloutRecord], int | None]:
        self.finish_in_flight()  # the batch in flight is the next step's: wait for it rather than lose it
        return ([self._ready] if self._ready is not None else []), None

    def restore(self, records: list[RolloutRecord], next_index: int) -> None:
        if len(records) > 1:
            raise ValueError(f"train.rollout_mode=one_step_off keeps one batch between steps; the checkpoint holds "
                             f"{len(records)} (written with rollout_mode=async?)")
        self._ready = records[0] if records else None

    def replace_pending(self, records: list[RolloutRecord]) -> None:
        if records:
            (self._ready,) = records

    def close(self) -> None:
        with contextlib.suppress(BaseException):
            self.finish_in_flight()


@dataclass
class _Queue:
    records: deque[RolloutRecord] = field(default_factory=deque)
    next_index: int = 0
    generating: int | None = None  # the batch the producer is generating now
    stop: bool = False
    error: BaseException | None = None


class AsyncSource(RolloutSource):
    """A producer thread keeps up to ``max_staleness`` finished batches queued; stale ones are dropped."""

    def __init__(self, *args: Any, max_staleness: int, current_version: Callable[[], int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if max_staleness < 1:
            raise ValueError(f"AsyncSource: max_staleness={max_staleness} must be >= 1")
        self.max_staleness = max_staleness
        self._current = current_version
        self._q = _Queue()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hacrl-rollout", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                # at the run's end the producer waits (a dropped batch still needs a replacement)
                self._cond.wait_for(lambda: self._q.stop or (len(self._q.records) < self.max_staleness
                                                             and self._generates(self._q.next_index)))
                if self._q.stop:
                    return
                index = self._q.generating = self._q.next_index
                self._q.next_index += 1
            try:
                record = self._produce(index)
            except BaseException as err:  # noqa: BLE001 - re-raised in the loop's thread
                with self._cond:
                    self._q.error = err
                    self._cond.notify_all()
                return
            with self._cond:
                self._q.records.append(record)
                self._q.generating = None
                self._cond.notify_all()

    def next(self, step: int) -> RolloutRecord:
        start = time.perf_counter()
        if self.concurrent:
            self._start()
        with self._cond:
            while True:
                if not self.concurrent:
                    self._fill_inline()
                self._cond.wait_for(lambda: self._q.records or self._q.error is not None)
                if self._q.error is not None:
                    raise self._q.error
                record = self._q.records.popleft()
                fresh = record.staleness(self._current()) <= self.max_staleness
                self.stats.dropped += not fresh
                self._cond.notify_all()  # room in the queue, or one more batch needed before the end
                if fresh:
                    break
        self.stats.wait_s = time.perf_counter() - start
        return record

    def _generates(self, index: int) -> bool:
        """Batch ``index`` is needed: before the run's end, moved on by one per dropped batch."""
        return self.end is None or index < self.end + self.stats.dropped

    def _fill_inline(self) -> None:
        """Without a thread: top the queue up to K + 1 batches with the current weights, here and now (the
        oldest is handed out, so a batch trains K versions after the weights that sampled it)."""
        while len(self._q.records) <= self.max_staleness and self._generates(self._q.next_index):
            index = self._q.next_index
            self._q.next_index += 1
            self._q.records.append(self._produce(index))

    def snapshot(self) -> tuple[list[RolloutRecord], int]:
        """Queued batches and where the producer goes on, under one lock: a batch that finishes after
        this instant is not among the records and its index is not past the position."""
        with self._cond:
            return list(self._q.records), self._position()

    def replace_pending(self, records: list[RolloutRecord]) -> None:
        with self._cond:
            by_index = {r.index: r for r in records}
            self._q.records = deque(by_index.get(r.index, r) for r in self._q.records)

    def next_index(self) -> int:
        """Where the producer goes on after a resume: the batch it is generating now (generated again
        from the same seeds), else the next one it would start."""
        with self._cond:
            return self._position()

    def _position(self) -> int:
        return self._q.generating if self._q.generating is not None else self._q.next_index

    def restore(self, records: list[RolloutRecord], next_index: int) -> None:
        with self._cond:
            self._q.records = deque(records)
            self._q.next_index = next_index

    def close(self) -> None:
        with self._cond:
            self._q.stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()


def make_source(mode: str, max_staleness: int, sample: Callable[[int], list[PromptRecord]], generate: Generate,
                version: Callable[[], dict[str, int]], current_version: Callable[[], int],
                concurrent: bool = True, end: int | None = None) -> RolloutSource:
    """The source of ``train.rollout_mode`` ``mode`` (``concurrent`` and ``end``: see :class:`RolloutSource`)."""
    if mode == "sync":
        return SyncSource(sample, generate, version, end=end)
    if mode == "one_step_off":
        return OneStepOffSource(sample, generate, version, concurrent, end=end)
    if mode == "async":
        return AsyncSource(sample, generate, version, concurrent, end=end, max_staleness=max_staleness,
                           current_version=current_version)
    raise ValueError(f"train.rollout_mode={mode!r}: one of sync, one_step_off, async")


def with_behaviour(record: RolloutRecord, behaviour: dict[str, list[float]]) -> RolloutRecord:
    return replace(record, behaviour=behaviour)
