"""tools/slurm_testbed.py's port choice: outside the kernel's ephemeral range, above Ray's worker ports,
free on every address (a port chosen now is bound minutes later by a job's Ray head)."""

from __future__ import annotations

import importlib
import socket

import pytest

bed = importlib.import_module("tools.slurm_testbed")


def test_quiet_ports_are_outside_the_ephemeral_range_and_above_rays_worker_ports():
    low, high = bed.ephemeral_port_range()
    for _ in range(20):
        ports = bed.quiet_ports(6)
        assert len(set(ports)) == 6
        assert all(p >= bed.QUIET_LOW and not low <= p <= high and p <= 65535 for p in ports), ports
    run = bed.ray_port_block()
    assert run == list(range(run[0], run[0] + bed.RAY_PORTS_PER_NODE))
    assert not any(low <= p <= high for p in run)


def test_a_port_taken_on_any_address_is_never_handed_out(monkeypatch):
    # hold a quiet port on 127.0.0.2 only: the wildcard check still sees it taken
    held = socket.socket()
    try:
        for port in bed.quiet_ports(50):
            try:
                held.bind(("127.0.0.2", port))
                break
            except OSError:
                continue
        taken = held.getsockname()[1]
        assert not bed._free_on_every_address(taken)
        # a quiet range of exactly the held port and the two next: only a run that avoids it is possible
        monkeypatch.setattr(bed, "QUIET_LOW", taken)
        monkeypatch.setattr(bed, "ephemeral_port_range", lambda: (taken + 3, 65535))
        for _ in range(20):
            assert bed.quiet_ports(2, consecutive=True) == [taken + 1, taken + 2]
        with pytest.raises(bed.BedError, match="no 3 free ports outside the ephemeral range"):
            bed.quiet_ports(3, consecutive=True)
    finally:
        held.close()


def test_no_room_outside_the_ephemeral_range_is_an_error_naming_it(monkeypatch):
    monkeypatch.setattr(bed, "ephemeral_port_range", lambda: (1024, 65535))
    with pytest.raises(bed.BedError, match=r"no room for 2 ports outside the ephemeral range 1024-65535"):
        bed.quiet_ports(2)
