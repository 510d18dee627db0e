"""Simulated-cluster tests release everything they place: after each test, a placement group that is
still reserved (CREATED, PENDING, RESCHEDULING) fails the test by name and is removed, so one failure
cannot starve the next test of its bundles (a leaked group once made the next test wait 600 s)."""

from __future__ import annotations

import os

import pytest

NODE_WAIT_ENV = "HACRL_TEST_NODE_WAIT_S"  # how long a simulated node may take to start (default generous: 300 s)


def node_wait_s() -> float:
    return float(os.environ.get(NODE_WAIT_ENV, "300"))


def held_groups() -> list[str]:
    """Names (or ids) of the placement groups still holding or waiting for bundles."""
    import ray

    if not ray.is_initialized():
        return []
    return [g.get("name") or g["placement_group_id"] for g in ray.util.placement_group_table().values()
            if g.get("state") in ("CREATED", "PENDING", "RESCHEDULING")]


@pytest.fixture(autouse=True)
def releases_every_placement_group():
    yield
    import ray

    left = held_groups()
    if left:
        from ray.util.placement_group import PlacementGroup

        for g in ray.util.placement_group_table().values():
            if g.get("state") in ("CREATED", "PENDING", "RESCHEDULING"):
                ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(g["placement_group_id"]))))
        pytest.fail(f"the test left placement groups behind: {left}")
