"""The weight-update session (SGLang 0.5.21 and later) around every tensor and distributed push, against
stand-in servers that refuse a push outside it as the real server does (HTTP 400 and its message):

- each push opens the session on every engine before the first bucket and closes it after the last;
  the server's release is read once (``/server_info``); releases without the routes get none;
- a bucket that fails still closes every session, and the error names the engine;
- a distributed bucket refused by one of two engines ends the push at once (no broadcast left
  waiting on the trainer's side for the group's timeout), names that engine, and the next push
  rebuilds the group and succeeds;
- a session a crashed trainer left open is closed and opened again.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from hacrl_megatron.rollout import HFEngine, SamplingParams, SGLangEngine
from hacrl_megatron.rollout.protocol import EngineError
from hacrl_megatron.rollout.sglang_engine import SGLangError, release_tuple
from hacrl_megatron.sync.distributed import DistributedTransport
from hacrl_megatron.sync.tensor import TensorTransport
from tests.fixtures.sglang_standin import StandIn
from tests.unit.test_rollout_hf import tiny_llama
from tests.unit.test_sync_transports import make_pool, prompts, tok  # noqa: F401  (tok: a fixture)

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0, max_new_tokens=6)
SESSION_ROUTES = ("/begin_weight_update", "/end_weight_update")


def routes(server, skip=("/health", "/generate")):
    return [path for path, _ in server.log if path not in skip]


def test_release_numbers():
    assert release_tuple("0.5.23") == (0, 5, 23) and release_tuple("0.5.15.post1") == (0, 5, 15)
    assert release_tuple("0.5.22rc1") == (0, 5, 22) and release_tuple("1.0") == (1, 0)
    with pytest.raises(ValueError, match="not a release number"):
        release_tuple("dev")


@pytest.mark.parametrize("kind", ["tensor", "distributed"])
def test_every_push_runs_inside_one_session_per_engine(tok, tmp_path, kind):  # noqa: F811
    pool, servers = make_pool(tok, kind, tmp_path, version="0.5.23")
    try:
        for seed in (1, 2):  # two pushes of several buckets each (40 kB buckets)
            pool.load_weights(tiny_llama(len(tok), seed=seed).state_dict().items())
        bucket = f"/update_weights_from_{kind}"
        for server in servers:
            seen = [p for p in routes(server) if p in (*SESSION_ROUTES, bucket, "/server_info")]
            assert seen[0] == "/server_info" and seen.count("/server_info") == 1  # the release, read once
            pushes = "".join({"/begin_weight_update": "(", "/end_weight_update": ")", bucket: "b"}[p] for p in seen[1:])
            assert re.fullmatch(r"\(b{2,}\)\(b{2,}\)", pushes), pushes  # every bucket of each push inside its session
            assert not server.handler.state.session_open
        expected = HFEngine(tiny_llama(len(tok), seed=2), tok).generate(prompts(tok), GREEDY)
        assert pool.generate(prompts(tok), GREEDY) == expected
    finally:
        pool.close()


@pytest.mark.parametrize("kind", ["tensor", "distributed"])
def test_releases_without_the_session_get_no_session_calls(tok, tmp_path, kind):  # noqa: F811
    pool, servers = make_pool(tok, kind, tmp_path, version="0.5.15.post1")
    try:
        pool.load_weights(tiny_llama(len(tok), seed=1).state_dict().items())
        assert all(not set(SESSION_ROUTES) & set(routes(s)) for s in servers)
        assert pool.generate(prompts(tok), GREEDY) == HFEngine(tiny_llama(len(tok), seed=1), tok).generate(
            prompts(tok), GREEDY)
    finally:
        pool.close()


def test_a_push_outside_the_session_is_refused_with_sglangs_message(tok):  # noqa: F811
    server = StandIn(lambda: HFEngine(tiny_llama(len(tok)), tok), version="0.5.21")
    server.start()
    try:
        engine = SGLangEngine(server.base_url, eos_token_id=tok.eos_token_id, timeout=30)
        with pytest.raises(SGLangError, match=r"HTTP 400: .*update_weights_from_tensor must run between "
                                              r"begin_weight_update\(\) and end_weight_update\(\)"):
            engine.update_weights_from_tensor(["x"], flush_cache=True, version=1)
        with pytest.raises(SGLangError, match=r"HTTP 400: .*no weight-update session is open"):
            engine.post("/end_weight_update", {})
    finally:
        server.kill()


def test_a_failed_tensor_bucket_still_closes_every_session_and_names_the_engine(tok, tmp_path):  # noqa: F811
    pool, servers = make_pool(tok, "tensor", tmp_path, version="0.5.23")
    try:
        good = list(tiny_llama(len(tok), seed=1).state_dict().items())
        bad = good[:3] + [("model.no_such_layer.weight", torch.zeros(4))]
        with pytest.raises(EngineError, match=r"engine engine\d \(http://127\.0\.0\.1:\d+\): "
                                              r"update_weights_from_tensor failed: .*HTTP 400"):
            TensorTransport(bucket_bytes=1 << 30).push(pool.engines, iter(bad), version=1)
        for server in servers:
            assert routes(server)[-1] == "/end_weight_update" and not server.handler.state.session_open
        pool.load_weights(good)  # the next push opens the session again
        assert pool.generate(prompts(tok), GREEDY) == HFEngine(tiny_llama(len(tok), seed=1), tok).generate(
            prompts(tok), GREEDY)
    finally:
        pool.close()


class ClosesItsSession(SGLangEngine):
    """An engine whose server loses the session right after it opened (the second bucket is then refused,
    as after a server-side end): the trainer's broadcast to it must not stay outstanding."""

    sabotage = True

    def begin_weight_update(self) -> None:
        super().begin_weight_update()
        if self.sabotage:
            self.post("/end_weight_update", {})


def test_a_refused_distributed_bucket_ends_the_push_at_once_and_the_next_push_rebuilds_the_group(tok):  # noqa: F811
    servers = [StandIn(lambda: HFEngine(tiny_llama(len(tok)), tok), version="0.5.23") for _ in range(2)]
    for s in servers:
        s.start()
    engines = [SGLangEngine(servers[0].base_url, eos_token_id=tok.eos_token_id, name="engine0", timeout=60),
               ClosesItsSession(servers[1].base_url, eos_token_id=tok.eos_token_id, name="engine1", timeout=60)]
    transport = DistributedTransport(40_000, backend="gloo", group_name="t", timeout_s=120)
    weights = list(tiny_llama(len(tok), seed=1).state_dict().items())
    try:
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"push failed at engine engine1 \(http://127\.0\.0\.1:\d+\).*"
                                              r"must run between begin_weight_update\(\)") as info:
            transport.push(engines, iter(weights), version=1)
        assert time.monotonic() - start < 30  # not the group's 120 s timeout
        assert "engine0: done" in str(info.value) and "taken down on every member" in str(info.value)
        for server in servers:  # both left the group; engine0 closed its session after the failure
            assert not server.handler.state.groups and not server.handler.state.session_open
        engines[1].sabotage = False
        assert transport.push(engines, iter(weights), version=2) == len(weights)
        expected = HFEngine(tiny_llama(len(tok), seed=1), tok).generate(prompts(tok), GREEDY)
        assert all(e.generate(prompts(tok), GREEDY) == expected for e in engines)
    finally:
        transport.close()
        for s in servers:
            s.kill()


def test_a_session_left_open_by_a_crashed_trainer_is_closed_and_reopened(tok):  # noqa: F811
    server = StandIn(lambda: HFEngine(tiny_llama(len(tok)), tok), version="0.5.23")
    server.start()
    try:
        engine = SGLangEngine(server.base_url, eos_token_id=tok.eos_token_id, name="engine0", timeout=30)
        engine.post("/begin_weight_update", {})  # what a trainer killed mid-push leaves behind
        TensorTransport().push([engine], iter(tiny_llama(len(tok), seed=3).state_dict().items()), version=1)
        assert routes(server)[-5:] == ["/begin_weight_update", "/end_weight_update", "/begin_weight_update",
                                       "/update_weights_from_tensor", "/end_weight_update"]
        assert engine.server_weight_version() == "1"
    finally:
        server.kill()


@pytest.mark.parametrize("kind", ["disk", "distributed"])
def test_an_update_whose_cache_flush_met_a_finishing_request_is_completed_by_flushing_again(tok, tmp_path, kind):  # noqa: F811
    """Real SGLang right after a generation: the weights load, the flush finds the request not yet
    retired, the update answers 400 "... the cache was not flushed ..."; the client flushes again."""
    pool, servers = make_pool(tok, kind, tmp_path, n_engines=1, version="0.5.23")
    try:
        servers[0].handler.state.busy_flushes = 3  # the update's flush and two /flush_cache retries refused
        pool.load_weights(tiny_llama(len(tok), seed=4).state_dict().items())
        assert [p for p in routes(servers[0]) if p == "/flush_cache"] == ["/flush_cache"] * 3
        assert pool.generate(prompts(tok), GREEDY) == HFEngine(tiny_llama(len(tok), seed=4), tok).generate(
            prompts(tok), GREEDY)
    finally:
        pool.close()
