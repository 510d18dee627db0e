"""``hacrl convert`` with MoE models in spawned gloo worlds: HF → Megatron at EP = 2 (DP2 × EP2) →
HF at TP2 · ETP2 (sequence parallel) → bit-identical to the saved HF folder; and the layout errors
named before any rank starts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from hacrl_megatron.cli import main as hacrl  # noqa: E402
from tests.distributed.moe_helpers import disk_state, make_tiny_moe  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]


@pytest.mark.parametrize("arch", ["qwen2_moe"])
def test_moe_round_trip_over_ep_and_etp_is_bit_identical(tmp_path, arch):
    make_tiny_moe(arch, str(tmp_path / "hf"), seed=6, layers=3)
    assert hacrl(["convert", "--from-hf", str(tmp_path / "hf"), "--to-megatron", str(tmp_path / "ep2"),
                  "--ep", "2", "--pp", "1"]) == 0
    assert hacrl(["convert", "--from-megatron", str(tmp_path / "ep2"), "--to-hf", str(tmp_path / "back"),
                  "--tp", "2"]) == 0  # ep = 1: the experts split like attention, etp = tp = 2
    saved, back = disk_state(str(tmp_path / "hf")), disk_state(str(tmp_path / "back"))
    assert set(back) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(back[name], tensor), name


def test_moe_layout_errors_before_spawning(tmp_path, capsys):
    make_tiny_moe("qwen3_moe", str(tmp_path / "hf"), seed=1)  # 4 experts, expert FFN 16
    assert hacrl(["convert", "--from-hf", str(tmp_path / "hf"), "--to-megatron", str(tmp_path / "x"), "--ep", "3"]) == 2
    assert "ep=3 does not divide num_experts=4" in capsys.readouterr().err
    assert hacrl(["convert", "--from-hf", str(tmp_path / "hf"), "--to-megatron", str(tmp_path / "x"), "--ep", "0"]) == 2
    assert "--ep=0" in capsys.readouterr().err
    from tests.distributed.megatron_helpers import make_tiny_hf

    make_tiny_hf("llama", str(tmp_path / "dense"))
    assert hacrl(["convert", "--from-hf", str(tmp_path / "dense"), "--to-megatron", str(tmp_path / "y"), "--ep", "2"]) == 2
    assert "expert parallelism needs an MoE model, llama is dense" in capsys.readouterr().err
