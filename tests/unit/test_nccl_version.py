"""NCCL versions of the trainer and the engines are compared before a weight-update group opens.

No GPU here: the trainer's version is stubbed, and the engines' come from their server handles
(a Ray-placed server's ``nccl_version()``), from a stand-in interpreter that prints what the
probe prints, or from this interpreter (a CPU torch: no NCCL, nothing to check).
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path

import pytest

from hacrl_megatron.errors import InputError
from hacrl_megatron.sync import nccl_version as nv
from hacrl_megatron.sync.distributed import DistributedTransport, RankSenderFactory
from hacrl_megatron.sync.vllm_nccl import VLLMNCCLTransport


class Server:
    """A server handle: a ``python -m`` command line, or a Ray handle's ``nccl_version()``."""

    def __init__(self, python: str = "", version: list[int] | None = None) -> None:
        self.python, self.version = python, version
        if version is not None:
            self.nccl_version = lambda: self.version

    def command_line(self) -> list[str]:
        return [self.python, "-m", "sglang.launch_server", "--port", "1"] if self.python else ["serve.sh", "--port"]


class Engine:
    def __init__(self, name: str, server: Server | None = None, tp_size: int = 1) -> None:
        self.name, self.server, self.tp_size = name, server, tp_size
        self.base_url = f"http://127.0.0.1:{3000 + len(name)}"
        self.calls: list[str] = []

    def health(self) -> bool:
        return True

    def init_weights_update_group(self, **kwargs) -> None:  # must never be reached on a mismatch
        self.calls.append("init_weights_update_group")

    def init_weight_transfer(self, info) -> None:
        self.calls.append("init_weight_transfer")

    def detached(self) -> Engine:
        return Engine(self.name, None, self.tp_size)


@pytest.fixture
def trainer_2273(monkeypatch):
    monkeypatch.setattr(nv, "local_nccl_version", lambda: (2, 27, 3))


def fake_python(tmp_path: Path, answer: str, name: str = "python") -> Path:
    """An executable that answers the probe like a real interpreter would, counting its runs."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\necho run >> '{tmp_path}/{name}.runs'\necho '{answer}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_mismatch_is_one_line_naming_both_versions_and_the_fix(trainer_2273):
    engine = Engine("sglang-0", Server(version=[2, 26, 2]))
    with pytest.raises(nv.NCCLVersionMismatch) as err:
        nv.check_nccl_versions("hacrl_small", [Engine("ok", Server(version=[2, 27, 3])), engine])
    message = str(err.value)
    assert "\n" not in message
    assert "NCCL 2.27.3 on the trainer" in message and "NCCL 2.26.2 on engine sglang-0" in message
    assert engine.base_url in message and "'hacrl_small'" in message
    assert "pip install nvidia-nccl-cu" in message and "==2.27.3" in message and "libnccl.so.2" in message
    assert isinstance(err.value, InputError)  # hacrl prints it as one line and exits 2


def test_equal_unknown_and_cpu_versions_pass(trainer_2273, monkeypatch):
    engines = [Engine("a", Server(version=[2, 27, 3])), Engine("custom", Server()), Engine("remote", None)]
    assert nv.check_nccl_versions("g", engines) == (2, 27, 3)
    # no NCCL in this process (CPU torch): nothing is read from the engines at all
    monkeypatch.setattr(nv, "local_nccl_version", lambda: None)
    assert nv.check_nccl_versions("g", [Engine("b", Server(version=[1, 0, 0]))]) is None


def test_known_versions_are_used_for_engines_without_handles(trainer_2273):
    engine = Engine("detached", None)  # what a Ray agent's rank 0 holds
    with pytest.raises(nv.NCCLVersionMismatch, match="NCCL 2.28.9 on engine detached"):
        nv.check_nccl_versions("g", [engine], known={engine.base_url: (2, 28, 9)})
    assert nv.check_nccl_versions("g", [engine], known={engine.base_url: None}) == (2, 27, 3)


def test_interpreter_probe_reads_the_engine_environment_once(tmp_path, trainer_2273):
    python = fake_python(tmp_path, '{"nccl": [2, 21, 5]}')
    server = Server(str(python))
    assert nv.server_interpreter(server) == str(python)
    assert nv.server_nccl_version(server) == (2, 21, 5)
    assert nv.engine_nccl_version(Engine("x", server)) == (2, 21, 5)  # cached: the interpreter ran once
    assert (tmp_path / "python.runs").read_text().count("run") == 1
    with pytest.raises(nv.NCCLVersionMismatch, match="NCCL 2.21.5 on engine x"):
        nv.check_nccl_versions("g", [Engine("x", server)])


def test_probe_without_nccl_or_failing_is_unknown(tmp_path, caplog):
    assert nv.interpreter_nccl_version(str(fake_python(tmp_path, '{"nccl": null}', "cpu_python"))) is None
    with caplog.at_level(logging.WARNING, logger=nv.__name__):
        assert nv.interpreter_nccl_version(str(tmp_path / "missing_python")) is None
        assert nv.interpreter_nccl_version(str(fake_python(tmp_path, "not json", "odd_python"))) is None
    assert "missing_python" in caplog.text and "odd_python" in caplog.text
    # this interpreter (a CPU torch here) answers without a subprocess: no NCCL
    assert nv.interpreter_nccl_version(sys.executable) == nv.local_nccl_version()
    assert nv.server_interpreter(Server()) is None  # a custom command: interpreter unknown


def test_real_probe_in_a_subprocess_matches_this_torch():
    env = {**os.environ, "LD_PRELOAD": ""}  # a different library setting forces the subprocess
    assert nv.interpreter_nccl_version(sys.executable, env) == nv.local_nccl_version()


def test_distributed_transport_refuses_before_the_rendezvous(trainer_2273):
    engines = [Engine("good", Server(version=[2, 27, 3])), Engine("bad", Server(version=[2, 19, 3]))]
    transport = DistributedTransport(1 << 20, backend="nccl", group_name="hacrl_a")
    with pytest.raises(nv.NCCLVersionMismatch, match="'hacrl_a'.*NCCL 2.19.3 on engine bad"):
        transport._ensure_group(engines)
    assert all(e.calls == [] for e in engines)  # no engine was asked to join


def test_gloo_groups_are_not_checked(trainer_2273):
    class Refusing(Engine):
        def init_weights_update_group(self, **kwargs) -> None:
            raise RuntimeError("refused by the stand-in")

    engine = Refusing("old", Server(version=[1, 0, 0]))
    transport = DistributedTransport(1 << 20, backend="gloo", timeout_s=2.0)
    with pytest.raises(RuntimeError, match="refused by the stand-in"):  # went on to the rendezvous
        transport._ensure_group([engine])


def test_vllm_transport_refuses_before_minting_the_nccl_id(trainer_2273, monkeypatch):
    import torch

    minted = []
    monkeypatch.setattr(torch.cuda.nccl, "unique_id", lambda: minted.append(1) or b"x" * 128, raising=False)
    engine = Engine("vllm-0", Server(version=[2, 26, 5]))
    with pytest.raises(nv.NCCLVersionMismatch, match="'vllm'.*2.26.5"):
        VLLMNCCLTransport(1 << 20)._ensure_group([engine])
    assert minted == [] and engine.calls == []


class Ranks:
    """A Ray agent's ranks: keeps the sender factory it is given (then the push fails on purpose)."""

    def __init__(self) -> None:
        self.factory = None

    def open_weight_sender(self, make_sender) -> None:
        self.factory = make_sender

    def push_weights(self, engines, version):
        raise RuntimeError("stop after the factory was built")

    def close_weight_sender(self) -> None:
        pass


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_ray_rank0_gets_the_versions_read_by_the_controller(kind, trainer_2273):
    engine = Engine("e0", Server(version=[2, 18, 1]))
    ranks = Ranks()
    transport = (DistributedTransport(1 << 20, backend="nccl", ranks=ranks) if kind == "sglang"
                 else VLLMNCCLTransport(1 << 20, ranks=ranks))
    with pytest.raises(RuntimeError, match="stop after"):
        transport._push_from_ranks([engine], 1)
    assert ranks.factory.engine_nccl == {engine.base_url: (2, 18, 1)}
    rank0 = ranks.factory(0).transport
    assert rank0.engine_nccl == {engine.base_url: (2, 18, 1)} and ranks.factory(1).transport is None
    with pytest.raises(nv.NCCLVersionMismatch, match="2.18.1"):  # rank 0 holds detached clients only
        nv.check_nccl_versions("g", [engine.detached()], rank0.engine_nccl)


def test_rank_sender_factory_default_has_no_versions():
    assert RankSenderFactory(1, "gloo", "g", None, 1.0)(0).transport.engine_nccl == {}
