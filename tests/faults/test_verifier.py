"""Fault injection on the shared verifier: hostile answers, math-verify's own alarms, workers that die.

The scorer objects below are module-level so spawned workers can load them by name
(``tests.faults.test_verifier``); loading one is part of a worker's start-up, which is where these
tests make a worker fail, block or succeed on demand.
"""

from __future__ import annotations

import os
import random
import re
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from hacrl_megatron.reward import RewardRequest, VerifierPool, score_request
from hacrl_megatron.reward import math_verify_backend as backend
from hacrl_megatron.reward.pool import MAX_STARTUP_FAILURES
from hacrl_megatron.reward.verify import score_request_with_event

GOOD = [
    (RewardRequest("math", "so \\boxed{\\frac12}", "0.5"), 1.0),
    (RewardRequest("math", "\\boxed{3}", "4"), 0.0),
    (RewardRequest("integer", " 85", "85"), 1.0),
    (RewardRequest("countdown", "\\boxed{(5+7)*2}", "24|2,3,5,7"), 1.0),
]
REQUESTS = [r for r, _ in GOOD]
EXPECTED = [e for _, e in GOOD]


# -- scorers whose loading (in the worker's start-up) fails, blocks or succeeds -------------------


def plain_score(request: RewardRequest, mode: str) -> float:
    return score_request(request, mode)


def _load_scorer(behaviour: str, path: str):
    """Runs when a worker unpickles its scorer, i.e. during start-up."""
    if behaviour == "fail":
        print(f"custom scorer cannot load its tables from {path}", file=__import__("sys").stderr)
        raise ImportError(f"no tables at {path}")
    if behaviour == "fail_once" and not os.path.exists(path):
        Path(path).touch()  # the next start finds it: one failure, then the worker comes up
        raise ImportError("first start fails")
    if behaviour == "gate":
        Path(path + ".waiting").touch()  # tell the test this worker is inside its start-up
        while not os.path.exists(path):  # the test opens the gate after killing this worker
            time.sleep(0.01)
    return plain_score


class LoadingScorer:
    """Pickles as a call to ``_load_scorer(behaviour, path)``: the scorer's start-up behaviour."""

    def __init__(self, behaviour: str, path: str) -> None:
        self.behaviour, self.path = behaviour, path

    def __reduce__(self):
        return _load_scorer, (self.behaviour, self.path)


def _wait_for(condition, what: str, limit_s: float = 120.0) -> None:
    """Poll ``condition`` (an explicit readiness check, not a blind sleep)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _is_dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- item 19: a worker that dies costs at most its in-flight item ----------------------------------


def test_worker_killed_during_start_up_is_replaced_and_costs_nothing(tmp_path):
    gate = str(tmp_path / "gate")
    with VerifierPool(num_workers=2, timeout_s=5.0, score_fn=LoadingScorer("gate", gate)) as pool:
        _wait_for(lambda: os.path.exists(gate + ".waiting"), "a worker inside its start-up")
        victim = pool.worker_pids[0]
        os.kill(victim, signal.SIGKILL)  # an OOM kill of a starting worker
        _wait_for(lambda: _is_dead(victim), "the killed worker to be gone")
        Path(gate).touch()
        assert pool.score(REQUESTS * 2) == EXPECTED * 2
        assert victim not in pool.worker_pids
        assert pool.stats == {"scored": 8, "timeouts": 0, "errors": 0, "guarded": 0, "restarts": 1}


def test_start_up_failing_once_is_survived(tmp_path):
    with VerifierPool(num_workers=1, timeout_s=5.0, score_fn=LoadingScorer("fail_once", str(tmp_path / "f"))) as pool:
        pool.wait_ready()
        assert pool.stats["restarts"] == 1
        assert pool.score(REQUESTS) == EXPECTED


def test_start_up_failing_three_times_in_a_row_is_fatal_with_its_stderr(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the workers' stderr captures go
    tables = str(tmp_path / "tables.bin")
    pool = VerifierPool(num_workers=1, timeout_s=5.0, score_fn=LoadingScorer("fail", tables))
    try:
        with pytest.raises(RuntimeError) as err:
            pool.wait_ready()
        text = str(err.value)
        assert f"failed to start {MAX_STARTUP_FAILURES} times in a row" in text
        assert f"custom scorer cannot load its tables from {tables}" in text  # the worker's stderr
        assert "ImportError: no tables at" in text  # and its traceback
        assert pool.stats["restarts"] == MAX_STARTUP_FAILURES - 1
    finally:
        pool.close()
    assert not list(tmp_path.glob("hacrl_verifier_*"))  # start-up captures removed


def test_idle_worker_killed_between_calls_costs_nothing():
    with VerifierPool(num_workers=2, timeout_s=5.0) as pool:
        pool.wait_ready()
        victim = pool.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        _wait_for(lambda: _is_dead(victim), "the killed worker to be gone")
        assert pool.score(REQUESTS * 2) == EXPECTED * 2
        assert victim not in pool.worker_pids
        assert pool.stats["restarts"] == 1 and pool.stats["errors"] == 0


# -- item 14: math-verify's own alarm is a timeout --------------------------------------------------


def test_math_verify_alarm_during_comparison_is_counted_as_a_timeout(monkeypatch):
    pytest.importorskip("math_verify")
    import math_verify.grader

    def endless_comparison(*args, **kwargs):
        time.sleep(60)  # math-verify's SIGALRM (1 s here) interrupts this

    monkeypatch.setattr(math_verify.grader, "sympy_expr_eq", endless_comparison)
    req = RewardRequest("math", "\\boxed{x+1}", "1+x")  # no string match: goes to the symbolic check
    assert score_request_with_event(req, "math_verify", math_verify_timeout_s=1.0) == (0.0, "timeout")
    with VerifierPool(num_workers=0, timeout_s=3.0, mode="math_verify") as pool:
        assert pool.score([req, GOOD[0][0]]) == [0.0, 1.0]
        assert pool.stats["timeouts"] == 1 and pool.stats["scored"] == 1 and pool.stats["errors"] == 0


# -- item 17: the explosive-input screen is linear ---------------------------------------------------

# the regular expressions of the old screen: the reference verdicts on short strings
OLD_SCREEN = [
    ("huge exponent", re.compile(r"(?:\^|\*\*)\s*[{(]?\s*[-+]?\d{5,}")),
    ("power tower", re.compile(r"\^\s*\{[^{}]*\^|\^\s*\(?\s*\d+\s*\)?\s*\^|\*\*\s*\(?\s*[\w.]+\s*\)?\s*\*\*")),
    ("huge factorial", re.compile(r"\d{4,}\s*!")),
    ("huge numeral", re.compile(r"\d{1000,}")),
]


def _old_verdict(text: str) -> str | None:
    for reason, pattern in OLD_SCREEN:
        if pattern.search(text):
            return reason
    return None if backend._nesting_depth(text) <= backend.MAX_NESTING else f"nesting deeper than {backend.MAX_NESTING}"


def test_linear_screen_agrees_with_the_old_regexes_on_random_short_strings():
    rng = random.Random(0)
    alphabet = ["^", "*", "**", "{", "}", "(", ")", "!", " ", "1", "12345", "2", "x", ".", "-", "+", "a_b"]
    for _ in range(20_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
        assert backend.looks_explosive(text) == _old_verdict(text), repr(text)


HOSTILE = {  # each took seconds to minutes with the old regexes (benchmarks/bench_explosive_screen.py)
    "20k-digit answer": ("1" * 20_000, "huge numeral"),
    "20k digits then !": ("7" * 19_990 + "  !", "huge factorial"),
    "^ then 20k blanks": ("^" + " " * 19_999, None),
    "** then blanks and a word": ("** " + " " * 6_000 + "a" * 6_000 + " " * 6_000, None),
    "^ then 20k digits": ("^" + "1" * 19_999, "huge exponent"),
}


class CountingStr(str):
    """A str that counts character reads (``text[i]`` and slices)."""

    reads = 0

    def __getitem__(self, key):
        CountingStr.reads += 1
        return super().__getitem__(key)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_answers_get_their_verdict_in_linear_reads(name):
    text, reason = HOSTILE[name]
    assert backend.looks_explosive(text) == reason
    CountingStr.reads = 0
    assert backend.looks_explosive(CountingStr(text)) == reason
    # a constant number of passes: a quadratic scan would read ~len² / 2 = 2e8 characters
    assert CountingStr.reads <= 12 * len(text), CountingStr.reads


def test_screen_uses_no_regular_expressions():
    """Backtracking regexes on untrusted text were the quadratic part; the screen scans by hand."""
    assert not [name for name, value in vars(backend).items() if isinstance(value, re.Pattern)]


def test_20k_digit_boxed_answer_is_guarded_not_evaluated():
    req = RewardRequest("math", "\\boxed{" + "9" * 20_000 + "}", "5")
    assert score_request_with_event(req, "math_verify") == (0.0, "guarded")
