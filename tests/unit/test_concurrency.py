"""trainer/concurrency.py: a stage's per-agent work runs concurrently where it runs elsewhere, in order
where it runs here, and fails only after every agent finished."""

import threading
from dataclasses import dataclass

import pytest

from hacrl_megatron.trainer.concurrency import for_each, runs_in_process


@dataclass
class Part:
    name: str
    runs_in_process: bool


def test_remote_items_overlap_and_local_ones_run_in_the_calling_thread():
    items = [Part("a", False), Part("b", True), Part("c", False)]
    both_remote = threading.Barrier(2, timeout=10)  # breaks (an error) unless a and c wait at the same time
    caller = threading.current_thread()

    def work(p: Part) -> str:
        if p.runs_in_process:
            assert threading.current_thread() is caller
        else:
            assert threading.current_thread() is not caller
            both_remote.wait()
        return p.name

    assert for_each(items, work, lambda p: p.runs_in_process) == ["a", "b", "c"]


def test_in_process_items_never_interleave():
    active, seen = [], []
    lock = threading.Lock()

    def work(p: Part) -> None:
        with lock:
            active.append(p.name)
            seen.append(len(active))
        with lock:
            active.remove(p.name)

    for_each([Part(str(i), True) for i in range(4)], work, lambda p: p.runs_in_process)
    assert seen == [1, 1, 1, 1]


def test_the_first_error_in_order_is_raised_after_all_finished():
    finished = []

    def work(p: Part) -> str:
        if p.name in ("b", "c"):
            raise ValueError(f"agent {p.name} failed")
        finished.append(p.name)
        return p.name

    with pytest.raises(ValueError, match="agent b failed"):
        for_each([Part("a", False), Part("b", False), Part("c", True), Part("d", False)], work,
                 lambda p: p.runs_in_process)
    assert sorted(finished) == ["a", "d"]


def test_objects_that_do_not_say_run_in_process():
    assert runs_in_process(object()) is True
    assert runs_in_process(Part("x", False)) is False
    assert runs_in_process(Part("x", False), object()) is True
