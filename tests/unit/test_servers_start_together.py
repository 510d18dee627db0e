"""rollout/servers.StartTogether: the servers of every agent come up at once (the loop builds the next
agent meanwhile); one failing start stops every server of the block and raises its error."""

from __future__ import annotations

import threading
import time

import pytest

from hacrl_megatron.rollout.servers import StartTogether, start_all


class SlowServer:
    def __init__(self, seconds: float, fail: bool = False) -> None:
        self.seconds, self.fail, self.running, self.stopped = seconds, fail, False, 0

    def start(self) -> str:
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("server exited with code 1 during start-up")
        self.running = True
        return "http://127.0.0.1:1"

    def stop(self) -> None:
        self.running, self.stopped = False, self.stopped + 1


def test_agents_servers_start_at_once_and_the_block_waits_for_them():
    agents = [[SlowServer(0.5), SlowServer(0.5)], [SlowServer(0.5)]]
    t0 = time.perf_counter()
    with StartTogether():
        for servers in agents:
            start_all(servers)
        launched = time.perf_counter() - t0
    assert launched < 0.3  # start_all returned without waiting
    assert all(s.running for servers in agents for s in servers)
    assert time.perf_counter() - t0 < 0.9  # 0.5 s together, not 1.0 s one agent after another


def test_a_failing_start_stops_every_server_of_the_block():
    good, bad = SlowServer(0.1), SlowServer(0.2, fail=True)
    with pytest.raises(RuntimeError, match="during start-up"):
        with StartTogether():
            start_all([good])
            start_all([bad])
    assert good.stopped == 1 and not good.running


def test_a_failing_build_waits_for_the_starts_then_stops_them_and_keeps_its_error():
    server = SlowServer(0.3)
    with pytest.raises(ValueError, match="agent 2"):
        with StartTogether():
            start_all([server])
            raise ValueError("agent 2: bad config")
    assert server.stopped == 1 and not server.running


def test_start_all_outside_the_block_or_in_another_thread_waits_itself():
    server = SlowServer(0.2)
    start_all([server])
    assert server.running
    other = SlowServer(0.2)
    with StartTogether():
        worker = threading.Thread(target=start_all, args=([other],))
        worker.start()
        worker.join()
        assert other.running  # another thread's start_all (a restart) is not deferred
