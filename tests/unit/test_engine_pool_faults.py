"""EnginePool: health means able to serve. A stand-in SGLang server switched to answering HTTP 500
(up, /health fine, as vLLM once its engine core died) is restarted and resynced like a dead one,
within the same call, with one warning naming the agent, the engine and the server's own error."""

from __future__ import annotations

import logging

import pytest
import torch

from hacrl_megatron.exchange import load_tokenizer
from hacrl_megatron.rollout import EngineError, HFEngine
from hacrl_megatron.rollout.engine_pool import MAX_FAULT_RESTARTS
from hacrl_megatron.sync.disk import DiskTransport
from tests.unit.test_engine_pool import GREEDY, pool_of, prompts
from tests.unit.test_rollout_hf import tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("char", tmp_path_factory.mktemp("tok"))


def fault_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "cannot serve" in r.getMessage()]


def test_a_server_answering_500_to_generate_is_restarted_and_resynced_within_the_call(tok, tmp_path, caplog):
    pool, servers = pool_of(tok, DiskTransport(tmp_path / "sync"), n=2)
    try:
        trained = tiny_llama(len(tok), seed=1)
        pool.load_weights(trained.state_dict().items())  # v1: what the restarted server must get back
        expected = HFEngine(trained, tok).generate(prompts(tok), GREEDY)
        servers[1].answer_5xx(500)
        with caplog.at_level(logging.WARNING, logger="hacrl_megatron.rollout.engine_pool"):
            assert pool.generate(prompts(tok), GREEDY) == expected  # its prompts went to engine0
        pool._join_recoveries()
        assert servers[1].restarts == 1 and pool.slots[1].state == "ready"
        assert pool.slots[1].lost_jobs >= 1 and servers[1].handler.state.weight_version == "1"
        (warning,) = fault_warnings(caplog)  # exactly one, naming agent, engine, status and the reply
        assert "agent 'a', engine1" in warning and "HTTP 500 to a generation" in warning
        assert "stand-in fault: the engine cannot serve" in warning
        # the restarted server serves the trained weights again
        before = len([p for p, _ in servers[1].log if p == "/generate"])
        assert pool.generate(prompts(tok) * 2, GREEDY) == expected * 2
        assert len([p for p, _ in servers[1].log if p == "/generate"]) > before
    finally:
        pool.close()


def test_the_only_engine_answering_500_is_restarted_and_the_call_still_returns(tok, tmp_path):
    pool, servers = pool_of(tok, DiskTransport(tmp_path / "sync"), n=1)
    try:
        trained = tiny_llama(len(tok), seed=2)
        pool.sync_from(lambda: trained.state_dict().items())
        servers[0].answer_5xx(503)
        assert pool.generate(prompts(tok), GREEDY) == HFEngine(trained, tok).generate(prompts(tok), GREEDY)
        assert servers[0].restarts == 1 and servers[0].handler.state.weight_version == "1"
    finally:
        pool.close()


@pytest.mark.parametrize("n", [1, 2], ids=["only_engine", "one_of_two"])
def test_a_server_answering_500_to_a_weight_update_is_restarted_and_gets_the_weights(tok, tmp_path, caplog, n):
    pool, servers = pool_of(tok, DiskTransport(tmp_path / "sync"), n=n)
    try:
        trained = tiny_llama(len(tok), seed=3)
        servers[0].answer_5xx(500)
        with caplog.at_level(logging.WARNING, logger="hacrl_megatron.rollout.engine_pool"):
            pool.sync_from(lambda: trained.state_dict().items())
        pool._join_recoveries()
        assert servers[0].restarts == 1 and pool.weight_version == 1
        assert all(s.handler.state.weight_version == "1" for s in servers)
        (warning,) = fault_warnings(caplog)
        assert "engine0" in warning and "HTTP 500 to a weight update" in warning
        assert pool.generate(prompts(tok), GREEDY) == HFEngine(trained, tok).generate(prompts(tok), GREEDY)
    finally:
        pool.close()


def test_a_server_that_keeps_answering_500_is_left_down_and_named(tok, tmp_path):
    pool, servers = pool_of(tok, DiskTransport(tmp_path / "sync"), n=1)
    server, start = servers[0], servers[0].start

    def start_broken():
        url = start()
        server.answer_5xx(500)
        return url

    try:
        server.answer_5xx(500)
        server.start = start_broken  # every restart comes back answering 500
        with pytest.raises(EngineError, match=r"engine0: dead .*HTTP 500"):
            pool.generate(prompts(tok), GREEDY)
        assert server.restarts == MAX_FAULT_RESTARTS
    finally:
        pool.close()
