"""`hacrl train` with a token budget and packed sequences logs the padded run's losses and rewards (same
seed), with less padding: the CLI face of tests/unit/test_packing.py, on the Megatron and HF backends.

Tolerance: 1e-5 relative on losses (float32; packed rows reassociate the sums, tests/unit/test_packing.py);
rewards are equal because the rollouts' sampled tokens are (a weight that differs in its last bits does not
flip a sample on this scale, checked over every step)."""

from __future__ import annotations

import json

import pytest

from hacrl_megatron.cli import main
from tests.e2e.test_trainer import tiny_exp
from tests.faults.trainer_helpers import preset_file

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("backend", ["megatron", "hf"])
def test_packed_run_logs_the_padded_runs_losses_with_less_padding(tmp_path, backend):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    preset = preset_file(tmp_path, tiny_exp(tmp_path, backend=backend, steps=2))
    runs = {}
    for name, extra in {"padded": [], "packed": ["train.max_tokens_per_microbatch=80", "train.pack_sequences=true"]}.items():
        out = tmp_path / name
        assert main(["train", "--preset", preset, f"output_dir={out}", *extra]) == 0
        runs[name] = _metrics(out)
    assert len(runs["padded"]) == len(runs["packed"]) == 2
    for padded, packed in zip(runs["padded"], runs["packed"]):
        for agent in ("llama", "qwen3"):
            assert packed[f"{agent}/reward_mean"] == padded[f"{agent}/reward_mean"]
            assert packed[f"{agent}/hacpo/loss"] == pytest.approx(padded[f"{agent}/hacpo/loss"], rel=1e-5, abs=1e-7)
            assert packed[f"{agent}/trainer/pad_fraction"] == 0.0 < padded[f"{agent}/trainer/pad_fraction"]
