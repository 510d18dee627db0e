"""``rollout.sglang.host`` with ``placement: ray``: one server runs on every node, so a fixed address
(or 0.0.0.0) would be bound and advertised by all of them; only empty or a per-node placeholder is
accepted, and the error names the key. The placeholder resolves on each node (engine_actor.bind_host)."""

from __future__ import annotations

import pytest

from hacrl_megatron.cli import main
from hacrl_megatron.config import ConfigError, load_config
from hacrl_megatron.rollout.engine_actor import bind_host, interface_address

RAY = ["rollout.engine=sglang", "rollout.sglang.placement=ray", "rollout.colocate=false"]


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "node1.cluster", "127.0.0.1"])
def test_fixed_host_with_ray_placement_is_refused_naming_the_key(host):
    with pytest.raises(ConfigError) as err:
        load_config("cpu_demo", RAY + [f"rollout.sglang.host={host}"])
    msg = str(err.value)
    assert msg.startswith(f"rollout.sglang.host='{host}': with rollout.sglang.placement=ray every node's server")
    assert "{node_ip}" in msg and "{iface:NAME}" in msg and "\n" not in msg


@pytest.mark.parametrize("host", ["", "{node_ip}", "{iface:ib0}", "{iface:eth0.100}"])
def test_empty_or_per_node_placeholder_is_accepted(host):
    # quoted: YAML reads a bare {node_ip} as a mapping (the same as in a preset file)
    cfg = load_config("cpu_demo", RAY + [f"rollout.sglang.host='{host}'"])
    assert cfg.rollout.sglang.host == host


def test_local_placement_keeps_any_bind_address():
    """placement local: one host, the servers are the trainer's children; the key is not multi-node."""
    assert load_config("cpu_demo", ["rollout.sglang.host=10.1.2.3"]).rollout.sglang.host == "10.1.2.3"


def test_malformed_placeholder_is_refused_by_the_range_check():
    with pytest.raises(ConfigError, match=r"rollout.sglang.host='\{iface:\}'"):
        load_config("cpu_demo", RAY + ["rollout.sglang.host='{iface:}'"])


def test_cli_exits_2_with_one_line(capsys, tmp_path):
    code = main(["train", "--preset", "cpu_demo", *RAY, "rollout.sglang.host=0.0.0.0",
                 f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "rollout.sglang.host='0.0.0.0'" in err


def test_placeholders_resolve_per_node():
    assert bind_host("", lambda: "10.0.0.7") == "10.0.0.7"
    assert bind_host("{node_ip}", lambda: "10.0.0.7") == "10.0.0.7"
    assert bind_host("{iface:lo}", lambda: "10.0.0.7") == "127.0.0.1"  # loopback's IPv4 address on this host
    with pytest.raises(OSError, match=r"rollout.sglang.host=\{iface:nosuch0\}: interface 'nosuch0' has no IPv4"):
        interface_address("nosuch0")
