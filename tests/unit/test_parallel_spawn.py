"""``spawn_local_world`` reports the first rank to fail, not whichever failed process ``mp.spawn`` noticed
first (models/parallel.py): a failing rank makes its peers fail in their next collective, and that
secondary error must not hide the cause."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch.multiprocessing as mp

from hacrl_megatron.models.parallel import first_failure, spawn_local_world


class SlowToPrintError(ValueError):
    """An error recorded at once (its first formatting) whose later formatting by ``mp.spawn``'s wrapper is
    slow, so that its rank exits well after it failed and after the peer it broke: the race in which
    ``mp.spawn`` alone reports the peer's error."""

    formatted = 0

    def __str__(self) -> str:
        SlowToPrintError.formatted += 1
        if SlowToPrintError.formatted > 1:
            time.sleep(1.5)
        return "the output folder is a file: blocker"


def fail_first_but_exit_last(rank: int, world: int, init_file: str) -> None:
    if rank == 0:
        raise SlowToPrintError()
    # the peer's collective breaks after rank 0 failed: wait for rank 0's record rather than for a fixed
    # time, which a loaded machine can outlast before rank 0 has even started
    record = os.path.join(os.path.dirname(init_file), "failure-rank0.json")
    deadline = time.monotonic() + 120
    while not os.path.exists(record) and time.monotonic() < deadline:
        time.sleep(0.05)
    raise RuntimeError("Connection closed by peer [127.0.0.1]:11422")


def succeed(rank: int, world: int, init_file: str, out_dir: str) -> None:
    assert os.path.basename(init_file) == "rendezvous" and not os.path.exists(init_file)
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(str(world))


def test_the_first_failure_is_reported_although_a_peer_exits_first(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with pytest.raises(mp.ProcessRaisedException, match="blocker") as caught:
        spawn_local_world(fail_first_but_exit_last, 2, prefix="hacrl_test_")
    assert caught.value.error_index == 0
    assert "Connection closed" not in str(caught.value)
    assert [p for p in tmp_path.iterdir() if p.name.startswith("hacrl_test_")] == []  # rendezvous folder removed


def test_a_world_that_succeeds_returns_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    spawn_local_world(succeed, 2, (str(tmp_path),), prefix="hacrl_test_")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("rank")) == ["rank0", "rank1"]
    assert list((tmp_path / "tmp").iterdir()) == []


def _record(folder, rank, at, trace):
    (folder / f"failure-rank{rank}.json").write_text(json.dumps({"time": at, "rank": rank, "pid": 100 + rank,
                                                                 "trace": trace}))


def test_first_failure_picks_the_earliest_record(tmp_path):
    noticed = mp.ProcessRaisedException("peer error", 1, 101)
    assert first_failure(noticed, str(tmp_path)) is noticed  # no records: what mp.spawn raised
    _record(tmp_path, 1, 20.0, "RuntimeError: Connection closed by peer")
    assert first_failure(noticed, str(tmp_path)) is noticed  # the noticed rank is the only one recorded
    _record(tmp_path, 0, 10.0, "NotADirectoryError: blocker/out")
    (tmp_path / "failure-rank2.json").write_text("{damaged")  # a rank killed mid-write is ignored
    got = first_failure(noticed, str(tmp_path))
    assert isinstance(got, mp.ProcessRaisedException)
    assert (got.error_index, got.error_pid) == (0, 100)
    assert "blocker/out" in str(got) and "process 1 failed after it" in str(got)
