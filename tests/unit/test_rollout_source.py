"""Rollout sources under load (trainer/rollout_source.py): the checkpoint's view of an asynchronous
producer is atomic, the loop gets the engines within one generate call, the run's end stops the
producer, and the loop's waits are reported. Generation is a stub that records which batches it
made (and can be slowed or held), so the threads' interleavings are forced rather than hoped for."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from hacrl_megatron.data.records import PromptRecord
from hacrl_megatron.rollout.types import Completion
from hacrl_megatron.trainer import loop
from hacrl_megatron.trainer.rollout_source import AsyncSource, OneStepOffSource


class Stub:
    """generate(index, prompts): one completion per prompt; ``hold[i]`` (an Event) blocks batch i until set."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds, self.made, self.started, self.hold = seconds, [], [], {}

    def sample(self, index: int) -> list[PromptRecord]:
        return [PromptRecord(id=f"p{index}", question=f"q{index}", answer="1", source="t", kind="integer")]

    def generate(self, index: int, prompts: list[PromptRecord]) -> dict[str, list[list[Completion]]]:
        self.started.append(index)
        if index in self.hold:
            assert self.hold[index].wait(30), f"batch {index} held for 30 s"
        time.sleep(self.seconds)
        self.made.append(index)
        return {"a": [[Completion(token_ids=(1, 2), text="12", finish_reason="stop")] for _ in prompts]}


def until(condition, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def async_source(stub: Stub, k: int, step: list[int], end: int | None = None) -> AsyncSource:
    bounded = {} if end is None else {"end": end}
    return AsyncSource(stub.sample, stub.generate, lambda: {"a": step[0]}, True, max_staleness=k,
                       current_version=lambda: step[0], **bounded)


def test_async_checkpoint_saves_or_regenerates_a_batch_that_finishes_while_it_is_written(monkeypatch):
    """The checkpoint reads the finished batches, fills in their behaviour log-probs (slow forward
    passes), and the producer's position. A batch finishing between the two reads must be saved or
    regenerated on resume; reading them apart lost it (saved neither, resumed past it)."""
    stub, step = Stub(), [0]
    stub.hold[1] = threading.Event()
    source = async_source(stub, k=2, step=step)
    source.restore([], 0)
    source._start()
    until(lambda: stub.made == [0] and stub.started == [0, 1])  # batch 0 queued, batch 1 generating
    step[0] = 1  # the checkpoint after step 0: batch 0 (version 0) needs its behaviour log-probs

    def slow_forward_passes(run, record):  # the producer finishes batch 1 during the passes
        stub.hold[1].set()
        until(lambda: 1 in [r.index for r in source._q.records])
        return {"a": [0.0]}

    monkeypatch.setattr(loop, "_behaviour", slow_forward_passes)
    try:
        state = loop._rollout_state(SimpleNamespace(source=source, step=step[0]))
    finally:
        source.close()
    saved = [r["index"] for r in state["records"]]
    regenerated_from = state["next_index"]
    assert saved == [0] and regenerated_from == 1  # batch 1 was in flight at the snapshot: made again
    assert sorted(set(saved) | set(range(regenerated_from, 3))) == [0, 1, 2]  # nothing lost, nothing twice
    assert all(r["behaviour"] == {"a": [0.0]} for r in state["records"])


def test_the_push_gets_the_engines_within_one_generate_call():
    """K = 8 keeps the producer busy batch after batch; the loop's turn comes after the call in flight."""
    stub, step = Stub(seconds=0.05), [0]
    source = async_source(stub, k=8, step=step)
    source.next(0)
    try:
        for _ in range(5):
            until(lambda: len(stub.started) > len(stub.made))  # a generate call is in flight
            asked = len(stub.started)
            with source.engines_idle():
                assert len(stub.started) == asked and len(stub.made) == asked  # it ended; no new one began
            time.sleep(0.01)
        assert source.stats.wait_s > 0  # the waits for the calls in flight are the loop's wait
    finally:
        source.close()


def test_one_step_off_reports_the_wait_for_the_batch_in_flight_and_stops_at_the_end():
    stub = Stub(seconds=0.3)
    source = OneStepOffSource(stub.sample, stub.generate, lambda: {"a": 0}, True, end=3)
    for step in range(3):
        record = source.next(step)
        assert record.index == step
        source.finish_in_flight()  # before the push: the next batch must sample with this step's weights
        with source.engines_idle():
            pass
        if step < 2:  # the batch in flight (0.3 s) was waited for after next() returned
            assert source.stats.wait_s >= 0.2
    source.close()
    assert stub.made == [0, 1, 2]  # nothing generated past the last step


@pytest.mark.parametrize("k", [1, 2])
def test_async_stops_at_the_runs_end_and_still_replaces_dropped_batches(k):
    stub, step = Stub(seconds=0.01), [0]
    source = async_source(stub, k=k, step=step, end=4)
    try:
        got = []
        for s in range(4):
            step[0] = s
            got.append(source.next(s).index)
        time.sleep(0.2)  # room for a producer that would overrun the end
        assert sorted(stub.made) == [0, 1, 2, 3] and got == [0, 1, 2, 3]
    finally:
        source.close()
    # a dropped batch (too stale) moves the end by one: the run still gets its steps
    stub, step = Stub(seconds=0.01), [0]
    source = async_source(stub, k=k, step=step, end=2)
    try:
        source.next(0)
        until(lambda: [r.index for r in source._q.records] == [1])  # the last batch before the end
        step[0] = k + 2  # batch 1 (version 0) is now more than K versions behind
        record = source.next(1)
        assert source.stats.dropped == 1 and record.index == 2 and sorted(stub.made) == [0, 1, 2]
    finally:
        source.close()
