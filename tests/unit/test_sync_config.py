"""rollout.weight_sync / colocate / weight_sync_bucket_mb and engines per agent: validation against
the layout (errors name the field), auto resolution, and the transport and GPU groups they give."""

from __future__ import annotations

import dataclasses

import pytest

from hacrl_megatron.config import ConfigError, load_config
from hacrl_megatron.rollout.sglang_server import gpu_groups
from hacrl_megatron.sync import make_transport, resolve_weight_sync
from hacrl_megatron.sync.disk import DiskTransport
from hacrl_megatron.sync.distributed import DistributedTransport
from hacrl_megatron.sync.tensor import TensorTransport


def cfg(*overrides):
    return load_config("cpu_demo", ["rollout.engine=sglang", *overrides])


@pytest.mark.parametrize("overrides, mode", [
    ((), "distributed"), (("rollout.colocate=true",), "tensor"), (("rollout.weight_sync=disk",), "disk"),
    (("rollout.engine=hf", "rollout.weight_sync=disk"), "disk"),
    (("rollout.weight_sync=tensor", "rollout.colocate=true"), "tensor"),
    (("rollout.weight_sync=distributed",), "distributed"),
])
def test_auto_and_explicit_modes_resolve(overrides, mode, tmp_path):
    r = cfg(*overrides).rollout
    assert resolve_weight_sync(r) == mode
    transport = make_transport(r, "a0", tmp_path / "sync", tmp_path / "init")
    assert isinstance(transport, {"disk": DiskTransport, "tensor": TensorTransport,
                                  "distributed": DistributedTransport}[mode])
    if mode != "disk":
        assert transport.bucket_bytes == 512 << 20


@pytest.mark.parametrize("overrides, field, rule", [
    (("rollout.weight_sync=nccl",), "rollout.weight_sync", "must be one of"),
    (("rollout.weight_sync=tensor",), "rollout.weight_sync", "set rollout.colocate: true"),
    (("rollout.weight_sync=distributed", "rollout.colocate=true"), "rollout.weight_sync", "use tensor"),
    (("rollout.weight_sync_bucket_mb=0",), "rollout.weight_sync_bucket_mb", "must be >= 1"),
    (("rollout.engine=hf", "rollout.colocate=true"), "rollout.colocate", "rollout.engine: sglang"),
    (("rollout.weight_sync=inprocess",), "rollout.weight_sync", r"rollout.engine=sglang takes weights by \['auto', 'disk'"),
    (("rollout.sglang.tp=2", "agents.0.rollout_gpu_ids=[0,1,2]"), "agents.0.rollout_gpu_ids", "multiple of"),
    (("agents.0.rollout_gpu_ids=[0,0]",), "agents.0.rollout_gpu_ids", "lists a GPU twice"),
])
def test_layout_rules_name_the_field(overrides, field, rule):
    with pytest.raises(ConfigError, match=rf"{field}=.*{rule}"):
        cfg(*overrides)


def test_the_hf_engine_copies_tensors_itself_unless_told_disk():
    r = load_config("cpu_demo").rollout
    assert resolve_weight_sync(r) == "inprocess"
    with pytest.raises(ValueError, match="weight_sync='inprocess' needs no transport"):
        make_transport(r, "a", None, None)
    with pytest.raises(ValueError, match="needs a sync_dir"):
        make_transport(load_config("cpu_demo", ["rollout.weight_sync=disk"]).rollout, "a", None, None)


def test_engines_per_agent_from_gpu_ids():
    exp = cfg("rollout.sglang.tp=2", "agents.0.rollout_gpu_ids=[4,5,6,7]")
    assert gpu_groups(exp.agents[0].rollout_gpu_ids, exp.rollout.sglang.tp) == [[4, 5], [6, 7]]
    assert gpu_groups([], 2) == [None]
    bucket = dataclasses.replace(exp.rollout, weight_sync_bucket_mb=3)
    assert make_transport(bucket, "a", None, None).bucket_bytes == 3 << 20
