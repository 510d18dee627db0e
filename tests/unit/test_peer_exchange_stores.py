"""The exchange stores (local, shared_dir, redis) behind one interface: round trip, the bounded wait for
a late peer, refused forged and damaged records, pruning, atomic writes, two writer processes at once.

The redis cases run against a real ``redis-server`` (tests/fixtures/redis_server.py: 127.0.0.1, a free
port, a password); they skip without one unless ``HACRL_REQUIRE_REDIS=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from hacrl_megatron.errors import InputError
from hacrl_megatron.exchange.remote import ExchangeRecordError, Limits, LocalStore, load_key, open_store
from hacrl_megatron.exchange.remote.shared_dir import SharedDirStore
from tests.fixtures.redis_server import redis_server  # noqa: F401 - the session fixture
from tests.unit.test_peer_exchange_record import KEY, make_record

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ["local", "shared_dir", pytest.param("redis", marks=pytest.mark.redis)]


@pytest.fixture
def make_store(request, tmp_path):
    """factory(run_id=None, key=None, limits=...) → a store of the test's backend; closed at the end.
    Stores made by one factory share their records (the same folder, server or process memory)."""
    backend = request.param
    opened, shared_local = [], {}
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)

    def factory(run_id: str | None = None, signed: bool = False, limits: Limits | None = None):
        run_id = run_id or f"run-{uuid.uuid4().hex[:8]}"
        extra = {"limits": limits} if limits else {}
        key = str(key_file) if signed else None
        if backend == "local":  # the stores of one run id share one memory, as jobs share a folder
            store = LocalStore(run_id, key=load_key(key) if key else None, share_with=shared_local.get(run_id),
                               **extra)
            shared_local.setdefault(run_id, store)
            return store
        if backend == "shared_dir":
            store = open_store("shared_dir", run_id, dir=tmp_path / "exchange", key_file=key, **extra)
        else:
            server = request.getfixturevalue("redis_server")
            store = open_store("redis", run_id, redis_url=server.url, redis_password_file=server.password_file,
                               key_file=key, **extra)
        opened.append(store)
        return store

    factory.backend = backend
    yield factory
    for store in opened:
        store.close()


def overwrite(store, step: int, agent: str, data: bytes) -> None:
    """Put raw bytes where (step, agent)'s record lives, as a hostile or broken writer would."""
    store._put(step, agent, data)


@pytest.mark.parametrize("make_store", BACKENDS, indirect=True)
def test_round_trip_between_two_jobs(make_store):
    writer = make_store("run-rt" + uuid.uuid4().hex[:6], signed=True)
    reader = make_store(writer.run_id, signed=True)
    a1, a2 = make_record(step=7, agent="agent1", run_id=writer.run_id), make_record(step=7, agent="agent2",
                                                                                   run_id=writer.run_id)
    writer.publish(a1)
    reader.publish(a2)
    assert reader.read(7, "agent1") == a1 and writer.read(7, "agent2") == a2
    assert reader.read(8, "agent1") is None
    result = reader.wait_for(7, ["agent1", "agent2"], wait_s=5)
    assert result.complete and result.records == {"agent1": a1, "agent2": a2} and result.waited_s < 1
    republished = make_record(step=7, agent="agent1", run_id=writer.run_id, weights_version=6)
    writer.publish(republished)  # a rerun of the step replaces the record whole
    assert reader.read(7, "agent1").weights_version == 6


@pytest.mark.parametrize("make_store", BACKENDS, indirect=True)
def test_the_last_claim_of_an_agent_holds(make_store):
    """Two jobs of one agent: the later claim wins and both see it (the earlier job then stops)."""
    first = make_store()
    second = make_store(first.run_id)
    assert first.holder_of("agent1") is None
    first.claim("agent1", "host-a:100:aa")
    assert second.holder_of("agent1") == "host-a:100:aa"
    second.claim("agent1", "host-b:200:bb")
    assert first.holder_of("agent1") == second.holder_of("agent1") == "host-b:200:bb"
    assert first.holder_of("agent2") is None  # claims are per agent
    with pytest.raises(ValueError, match="must be 1 to 256 characters"):
        first.claim("agent1", "x" * 257)
    with pytest.raises(ValueError):
        first.claim("../agent1", "host-a:1:cc")  # an agent name that is not one


@pytest.mark.parametrize("make_store", BACKENDS, indirect=True)
def test_wait_with_a_late_peer(make_store):
    store = make_store()
    late = make_store(store.run_id)
    store.publish(make_record(step=2, agent="agent1", run_id=store.run_id))
    t0 = time.monotonic()
    result = store.wait_for(2, ["agent1", "agent2"], wait_s=0.3)
    elapsed = time.monotonic() - t0
    assert result.missing == ("agent2",) and list(result.records) == ["agent1"] and not result.complete
    assert 0.3 <= elapsed < 2.0  # bounded by wait_s (generous upper bound: a loaded 2-core machine)
    timer = threading.Timer(0.2, late.publish, [make_record(step=2, agent="agent2", run_id=store.run_id)])
    timer.start()
    try:
        result = store.wait_for(2, ["agent1", "agent2"], wait_s=10)
    finally:
        timer.join()
    assert result.complete and result.records["agent2"].agent == "agent2"
    assert 0.15 <= result.waited_s < 5  # returned when the late peer arrived, long before wait_s
    assert store.wait_for(2, ["agent3"], wait_s=0).missing == ("agent3",)


@pytest.mark.parametrize("make_store", BACKENDS, indirect=True)
def test_forged_record_refused_naming_author(make_store, caplog):
    store = make_store(signed=True)
    genuine = make_record(step=1, agent="agent2", run_id=store.run_id)
    obj = json.loads(genuine.to_json(KEY))
    obj["rewards"] = [[1.0, 1.0], [1.0, 1.0]]  # an attacker's edit, the old signature kept
    overwrite(store, 1, "agent2", json.dumps(obj).encode())
    with pytest.raises(ExchangeRecordError, match=r"^exchange record of agent 'agent2' refused .*'hmac_sha256'"):
        store.read(1, "agent2")
    unsigned = make_store(store.run_id)  # a writer without the key
    unsigned.publish(make_record(step=3, agent="agent2", run_id=store.run_id))
    with pytest.raises(ExchangeRecordError, match="agent 'agent2'.*missing"):
        store.read(3, "agent2")
    with caplog.at_level("WARNING"):
        result = store.wait_for(1, ["agent2"], wait_s=0.1)
    assert result.missing == ("agent2",) and "hmac_sha256" in result.refused["agent2"]
    assert sum("agent 'agent2'" in r.getMessage() for r in caplog.records) == 1  # logged once, not per poll
    store.publish(genuine)  # the real author's record replaces the forged one
    assert store.wait_for(1, ["agent2"], wait_s=1).records == {"agent2": genuine}


@pytest.mark.parametrize("make_store", BACKENDS, indirect=True)
@pytest.mark.parametrize("damage, field", [
    (lambda text: text[: len(text) // 2], "record"),  # truncated JSON
    (lambda text: text.replace('"run_id": "', '"run_id": "other-', 1), "run_id"),
    (lambda text: text.replace('"step": 5', '"step": 6', 1), "step"),
    (lambda text: text.replace("[1.0, 0.0]", "[NaN, 0.0]", 1), "record"),
    (lambda text: text.replace('"agent": "agent2"', '"agent": "agent3"', 1), "agent"),
])
def test_damaged_record_refused_naming_author(make_store, damage, field):
    store = make_store()
    text = make_record(step=5, agent="agent2", run_id=store.run_id).to_json().decode()
    overwrite(store, 5, "agent2", damage(text).encode())
    with pytest.raises(ExchangeRecordError) as err:
        store.read(5, "agent2")
    assert str(err.value).startswith("exchange record of agent 'agent2' refused (")
    assert f"field {field!r}" in str(err.value)
    result = store.wait_for(5, ["agent2"], wait_s=0)
    assert result.missing == ("agent2",) and f"field {field!r}" in result.refused["agent2"]


@pytest.mark.parametrize("make_store", BACKENDS, indirect=True)
def test_oversized_record_refused(make_store):
    record = make_record(step=0, agent="agent2", responses=[["x" * 4000, "y"], ["z", "w"]],
                         response_tokens=[[4000, 12], [1, 1]])
    limit = len(record.to_json()) - 10
    store = make_store(record.run_id, limits=Limits(max_bytes=limit))
    with pytest.raises(ValueError, match="more than the limit"):
        store.publish(record)  # a writer refuses what its readers would
    overwrite(store, 0, "agent2", record.to_json())
    with pytest.raises(ExchangeRecordError, match=rf"agent 'agent2'.*larger than the limit of {limit} bytes"):
        store.read(0, "agent2")


@pytest.mark.parametrize("make_store", BACKENDS, indirect=True)
def test_prune_keeps_the_last_steps_of_own_records(make_store):
    store = make_store()
    for step in range(6):
        for agent in ("agent1", "agent2"):
            store.publish(make_record(step=step, agent=agent, run_id=store.run_id))
    assert store.prune("agent1", step=5, keep_steps=2) == 4  # steps 0..3 go, 4 and 5 stay
    assert [s for s in range(6) if store.read(s, "agent1")] == [4, 5]
    assert [s for s in range(6) if store.read(s, "agent2")] == list(range(6))  # a peer's records untouched
    assert store.prune("agent1", step=5, keep_steps=2) == 0
    other = make_store()  # another run's namespace is separate
    other.publish(make_record(step=0, agent="agent2", run_id=other.run_id))
    assert other.prune("agent2", step=9, keep_steps=1) == 1 and store.read(0, "agent2") is not None
    with pytest.raises(ValueError, match="keep_steps"):
        store.prune("agent1", step=5, keep_steps=0)


@pytest.mark.parametrize("make_store", BACKENDS, indirect=True)
def test_publish_refuses_another_runs_record_and_bad_names(make_store):
    store = make_store()
    with pytest.raises(ValueError, match="published to run"):
        store.publish(make_record(run_id="someone-else"))
    with pytest.raises(InputError, match="agent name"):
        store.read(0, "../etc")


def test_shared_dir_layout_is_one_readable_file_per_step_and_agent(tmp_path):
    store = SharedDirStore(tmp_path / "ex", "run-a")
    store.publish(make_record(step=12, agent="agent1"))
    files = sorted(p.name for p in (tmp_path / "ex" / "run-a").iterdir())
    assert files == ["step-00000012.agent1.json"]  # no temporary file left behind
    text = (tmp_path / "ex" / "run-a" / files[0]).read_text()
    assert text.startswith('{\n "agent": "agent1",\n') and json.loads(text)["step"] == 12
    with pytest.raises(InputError, match="exchange run id"):
        SharedDirStore(tmp_path / "ex", "../up")
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match="is not a folder"):
        SharedDirStore(tmp_path / "file", "run-a")


def test_shared_dir_refuses_links_and_pipes_naming_the_author(tmp_path):
    store = SharedDirStore(tmp_path / "ex", "run-a")
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(make_record(step=0, agent="agent2").to_json())
    store.path(0, "agent2").symlink_to(elsewhere)  # a valid record, but not the author's file
    with pytest.raises(ExchangeRecordError, match=r"agent 'agent2'.*'record': a symbolic link"):
        store.read(0, "agent2")
    os.mkfifo(store.path(1, "agent2"))  # a named pipe would block a plain open() forever
    with pytest.raises(ExchangeRecordError, match=r"agent 'agent2'.*'record': not a regular file"):
        store.read(1, "agent2")
    assert store.wait_for(1, ["agent2"], wait_s=0).missing == ("agent2",)


def test_open_store_names_missing_options(tmp_path):
    with pytest.raises(InputError, match="exchange.dir: required"):
        open_store("shared_dir", "run-a")
    with pytest.raises(InputError, match="exchange.redis_url: required"):
        open_store("redis", "run-a")
    with pytest.raises(InputError, match="exchange.backend='nfs'"):
        open_store("nfs", "run-a")
    with pytest.raises(InputError, match="carries a password"):
        open_store("redis", "run-a", redis_url="redis://:hunter2@127.0.0.1:1/0")
    with pytest.raises(InputError, match="must be redis://"):
        open_store("redis", "run-a", redis_url="http://127.0.0.1:1")


WRITER = textwrap.dedent("""
    import json, sys
    from hacrl_megatron.exchange.remote import open_store
    from tests.unit.test_peer_exchange_record import make_record
    backend, options, run_id, agent, rounds = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    CONTENDED = 1000  # the step both writers rewrite (a step no older than any weights version written)
    store = open_store(backend, run_id, **options)
    for i in range(rounds):
        # alternate a long and a short record at the same (step, agent): a torn read would show
        text = "x" * (20000 if i % 2 else 10)
        store.publish(make_record(step=CONTENDED, agent=agent, run_id=run_id, weights_version=i,
                                  responses=[[text, agent], ["a", "b"]], response_tokens=[[len(text), 12], [1, 1]]))
        store.publish(make_record(step=1 + i % 3, agent=agent, run_id=run_id))
""")


CONTENDED = 1000  # as in WRITER


@pytest.mark.parametrize("backend", ["shared_dir", pytest.param("redis", marks=pytest.mark.redis)])
def test_two_writer_processes_and_a_reader_never_see_a_partial_record(backend, tmp_path, request):
    rounds, run_id = 30, f"run-{uuid.uuid4().hex[:8]}"
    if backend == "shared_dir":
        options = {"dir": str(tmp_path / "ex")}
    else:
        server = request.getfixturevalue("redis_server")
        options = {"redis_url": server.url, "redis_password_file": str(server.password_file)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, backend, json.dumps(options), run_id, agent,
                               str(rounds)], cwd=ROOT, stderr=subprocess.PIPE) for agent in ("agent1", "agent2")]
    store = open_store(backend, run_id, **options)
    reads = 0
    try:
        while any(p.poll() is None for p in procs):
            for agent in ("agent1", "agent2"):
                record = store.read(CONTENDED, agent)  # raises on a partial or mixed record
                if record is not None:
                    reads += 1
                    assert record.responses[0][1] == agent
                    assert len(record.responses[0][0]) == (20000 if record.weights_version % 2 else 10)
    finally:
        errors = [p.communicate(timeout=60)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert reads > 0
    final = store.wait_for(CONTENDED, ["agent1", "agent2"], wait_s=0)
    assert final.complete and {r.weights_version for r in final.records.values()} == {rounds - 1}
    assert all(store.read(s, a) is not None for s in (CONTENDED, 1, 2, 3) for a in ("agent1", "agent2"))
    if backend == "shared_dir":  # no temporary file left behind
        assert sorted(p.name for p in (tmp_path / "ex" / run_id).iterdir()) == sorted(
            f"step-{s:08d}.{a}.json" for s in (CONTENDED, 1, 2, 3) for a in ("agent1", "agent2"))
    store.close()


def test_shared_dir_io_failures_are_one_line_naming_the_folder(tmp_path, monkeypatch):
    import errno
    import shutil

    from hacrl_megatron.durable import OutOfSpaceError
    from hacrl_megatron.exchange.remote import ExchangeBackendError

    store = SharedDirStore(tmp_path / "ex", "run-a")
    store.publish(make_record(step=0, agent="agent1"))

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "write", full)
        with pytest.raises(OutOfSpaceError, match=rf"exchange.dir {store.folder}: no space left on the device for "
                                                  r"writing step-00000001.agent1.json"):
            store.publish(make_record(step=1, agent="agent1"))
    assert [p.name for p in store.folder.iterdir()] == ["step-00000000.agent1.json"]  # no temporary file left
    shutil.rmtree(store.folder)
    store.folder.write_text("not a folder")  # the run's folder replaced by a file mid-run
    with pytest.raises(ExchangeBackendError, match=rf"exchange folder {store.folder}: writing "
                                                   r"step-00000001.agent1.json failed: Not a directory"):
        store.publish(make_record(step=1, agent="agent1"))
    with pytest.raises(ExchangeBackendError, match="listing it failed: Not a directory"):
        store.prune("agent1", 5, 1)
