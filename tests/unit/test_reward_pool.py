"""VerifierPool: per-item timeouts, worker crashes and replacement, pathological inputs, stats.

The custom scorers below are module-level functions so spawned workers can import them by name
(``tests.unit.test_reward_pool``); they make a hang or a crash happen on a chosen item.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from hacrl_megatron.reward import RewardRequest, VerifierPool, score_request

# -- scorers run inside worker processes ---------------------------------------------------------


def hang_or_score(request: RewardRequest, mode: str) -> float:
    if request.response == "HANG":
        time.sleep(600)
    return score_request(request, mode)


def crash_or_score(request: RewardRequest, mode: str) -> float:
    if request.response == "CRASH":
        os._exit(3)  # a hard death: no exception, no result
    if request.response == "RAISE":
        raise RuntimeError("scorer bug")
    return score_request(request, mode)


def unguarded_math_verify(request: RewardRequest, mode: str) -> float:
    """math-verify with no explosive-input screen and a 60 s internal limit: only the pool's
    per-item timeout can stop a pathological item."""
    from hacrl_megatron.reward.math_verify_backend import math_verify_equal

    return 1.0 if math_verify_equal(request.response, request.reference, timeout_s=60) else 0.0


# -- helpers ---------------------------------------------------------------------------------------

GOOD = [
    (RewardRequest("math", "so \\boxed{\\frac12}", "0.5"), 1.0),
    (RewardRequest("math", "\\boxed{3}", "4"), 0.0),
    (RewardRequest("integer", " 85", "85"), 1.0),
    (RewardRequest("countdown", "\\boxed{(5+7)*2}", "24|2,3,5,7"), 1.0),
    (RewardRequest("math", "\\boxed{x=2}", "2"), 1.0),
]


def _batch_with(bad: RewardRequest) -> tuple[list[RewardRequest], list[float]]:
    """Normal items on both sides of one bad item; expected scores (bad → 0)."""
    reqs = [r for r, _ in GOOD[:2]] + [bad] + [r for r, _ in GOOD[2:]]
    expected = [e for _, e in GOOD[:2]] + [0.0] + [e for _, e in GOOD[2:]]
    return reqs, expected


# -- tests -----------------------------------------------------------------------------------------


def test_pool_matches_in_process_scoring_and_reuses_workers():
    reqs = [r for r, _ in GOOD] * 3
    with VerifierPool(num_workers=2, timeout_s=5.0) as pool:
        pids = pool.worker_pids
        first = pool.score(reqs)
        second = pool.score(reqs)
        assert pool.worker_pids == pids  # alive between calls, nothing restarted
        assert pool.stats == {"scored": 30, "timeouts": 0, "errors": 0, "guarded": 0, "restarts": 0}
    in_process = VerifierPool(num_workers=0).score(reqs)
    assert first == second == in_process == [e for _, e in GOOD] * 3


def test_hanging_item_times_out_others_scored_and_worker_replaced():
    reqs, expected = _batch_with(RewardRequest("math", "HANG", "1"))
    with VerifierPool(num_workers=2, timeout_s=1.0, score_fn=hang_or_score) as pool:
        pool.wait_ready()  # workers started: the elapsed time below is the items' alone
        t0 = time.monotonic()
        scores = pool.score(reqs)
        elapsed = time.monotonic() - t0
        assert scores == expected
        assert elapsed < 30.0  # one 1 s timeout, not 600 s (generous: the suite must pass on a loaded machine)
        stats = pool.stats
        assert stats["timeouts"] == 1 and stats["restarts"] == 1 and stats["errors"] == 0
        assert pool.score([r for r, _ in GOOD]) == [e for _, e in GOOD]  # replacement works


def test_worker_crash_scores_zero_is_counted_and_replaced():
    reqs, expected = _batch_with(RewardRequest("math", "CRASH", "1"))
    with VerifierPool(num_workers=2, timeout_s=5.0, score_fn=crash_or_score) as pool:
        before = set(pool.worker_pids)
        assert pool.score(reqs) == expected
        assert pool.stats["errors"] == 1 and pool.stats["restarts"] == 1 and pool.stats["timeouts"] == 0
        assert set(pool.worker_pids) != before
        assert all(p is not None for p in pool.worker_pids)
        assert pool.score([r for r, _ in GOOD]) == [e for _, e in GOOD]


def test_exception_in_scorer_is_counted_and_worker_survives():
    reqs, expected = _batch_with(RewardRequest("math", "RAISE", "1"))
    with VerifierPool(num_workers=1, timeout_s=5.0, score_fn=crash_or_score) as pool:
        pid = pool.worker_pids
        assert pool.score(reqs) == expected
        assert pool.stats["errors"] == 1 and pool.stats["restarts"] == 0
        assert pool.worker_pids == pid


def _wait_until_dead(pid: int, limit_s: float = 60.0) -> None:
    """Poll until the killed worker is a zombie (an explicit condition, not a fixed sleep)."""
    import psutil

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.01)
    raise AssertionError(f"worker {pid} still alive {limit_s} s after SIGKILL")


def test_externally_killed_idle_worker_is_replaced():
    with VerifierPool(num_workers=2, timeout_s=5.0) as pool:
        pool.wait_ready()  # both workers started: the kill hits an idle, ready worker
        assert pool.score([GOOD[0][0]]) == [1.0]
        victim = pool.worker_pids[0]
        os.kill(victim, signal.SIGKILL)
        _wait_until_dead(victim)
        scores = pool.score([r for r, _ in GOOD] * 2)
        assert scores == [e for _, e in GOOD] * 2
        assert victim not in pool.worker_pids
        assert pool.stats["restarts"] == 1


def test_real_math_verify_pathological_item_is_killed_by_the_pool():
    """Unscreened math-verify on 9^{9^{9}} vs 5 does not return for minutes; the pool's 5 s
    per-item limit kills it while the normal items are still scored correctly. The normal items are
    cheap checks (a symbolic expansion can take over 5 s on a heavily loaded 2-core machine)."""
    reqs = [
        RewardRequest("math", "\\boxed{\\frac{1}{2}}", "0.5"),
        RewardRequest("math", "\\boxed{9^{9^{9}}}", "5"),
        RewardRequest("math", "\\boxed{7.0}", "7"),
    ]
    with VerifierPool(
        num_workers=2, timeout_s=5.0, mode="math_verify", score_fn=unguarded_math_verify
    ) as pool:
        pool.wait_ready()  # start-up (importing math-verify) is not part of the bound below
        t0 = time.monotonic()
        scores = pool.score(reqs)
        assert time.monotonic() - t0 < 30.0  # one 5 s timeout, not minutes
        assert scores == [1.0, 0.0, 1.0]
        assert pool.stats["timeouts"] == 1


@pytest.mark.parametrize("num_workers", [0, 1])
def test_builtin_scorer_pathological_inputs(num_workers):
    """The built-in scorer screens explosive answers before math-verify (counted as guarded),
    refuses giant responses (counted as errors) and scores binary junk 0 — fast, in or out of process."""
    junk = bytes(random.Random(0).getrandbits(8) for _ in range(4000)).decode("utf-8", errors="replace")
    bad = [
        RewardRequest("math", "\\boxed{9^{9^{9}}}", "5"),
        RewardRequest("math", "\\boxed{10^{1000000}}", "5"),
        RewardRequest("math", "9**9**9", "5"),
        RewardRequest("math", "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}", "1"),
        RewardRequest("math", "1" * 2_000_000, "1"),
        RewardRequest("math", junk + "\\boxed{" + junk, "1"),
        RewardRequest("countdown", junk, "24|2,3,5,7"),
        RewardRequest("integer", "\x00\x01\xff", "3"),
    ]
    good = [r for r, _ in GOOD]
    with VerifierPool(num_workers=num_workers, timeout_s=5.0, mode="math_verify") as pool:
        pool.wait_ready()
        t0 = time.monotonic()
        scores = pool.score(good + bad)
        assert time.monotonic() - t0 < 60.0  # no item runs unbounded (the counts below say which guard acted)
        assert scores == [e for _, e in GOOD] + [0.0] * len(bad)
        stats = pool.stats
        assert stats["guarded"] == 4  # the three explosive answers and the deep nesting
        assert stats["errors"] == 1  # the 2 MB response
        assert stats["timeouts"] == 0


def test_validation_errors():
    with pytest.raises(ValueError, match="num_workers"):
        VerifierPool(num_workers=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        VerifierPool(num_workers=0, timeout_s=0)
    with pytest.raises(ValueError, match="mode='exact'"):
        VerifierPool(num_workers=0, mode="exact")
    with pytest.raises(ValueError, match="start_method='fork'"):
        VerifierPool(num_workers=0, start_method="fork")
    pool = VerifierPool(num_workers=0)
    with pytest.raises(TypeError, match=r"requests\[0\] must be a RewardRequest"):
        pool.score([("math", "\\boxed{1}", "1")])
    pool.close()
    with pytest.raises(RuntimeError, match="after close"):
        pool.score([])
