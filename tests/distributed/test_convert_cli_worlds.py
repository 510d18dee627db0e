"""``hacrl convert`` spawning its own 2-rank gloo worlds: HF → Megatron at TP = 2 → HF at PP = 2."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from hacrl_megatron.cli import main as hacrl  # noqa: E402
from hacrl_megatron.models.convert import SafetensorsSource  # noqa: E402
from tests.distributed.megatron_helpers import make_tiny_hf  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]


def test_convert_reshards_tp2_to_pp2_bit_identically(tmp_path):
    hf = make_tiny_hf("qwen3", str(tmp_path / "hf"))  # vocab 97: padded to 98 rows at TP = 2
    assert hacrl(["convert", "--from-hf", str(tmp_path / "hf"), "--to-megatron", str(tmp_path / "tp2"), "--tp", "2"]) == 0
    assert hacrl(["convert", "--from-megatron", str(tmp_path / "tp2"), "--to-hf", str(tmp_path / "back"), "--pp", "2"]) == 0
    out = SafetensorsSource(str(tmp_path / "back"))
    expected = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    assert out.keys() == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(out.get(name), tensor), name
