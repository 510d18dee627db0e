"""HFAgent (plain transformers + AdamW) as an AgentHandle: log-probs equal the HF model's, train_async is train."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hacrl_megatron.agents.handle import AgentHandle, CompletedResult  # noqa: E402
from hacrl_megatron.agents.hf import HFAgent  # noqa: E402
from hacrl_megatron.config import TrainConfig  # noqa: E402
from tests.distributed.megatron_helpers import (  # noqa: E402
    hf_reference_step,
    hf_seq_logprobs,
    make_tiny_hf,
    sample_batch,
    sft_loss,
)


def test_hf_agent_is_an_agent_handle_and_train_async_runs_train_now(tmp_path):
    torch.set_num_threads(1)
    hf = make_tiny_hf("llama", str(tmp_path / "hf"), seed=5)
    batch = sample_batch()
    agent = HFAgent("a", copy.deepcopy(hf), lr=1e-3, train_cfg=TrainConfig(micro_batch_size=3))
    assert isinstance(agent, AgentHandle)
    sums, lens = agent.sequence_logprobs(batch)
    torch.testing.assert_close(sums, hf_seq_logprobs(hf, batch).detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(lens, batch.response_lens)

    pending = agent.train_async([batch], sft_loss)
    assert isinstance(pending, CompletedResult) and agent.updates == 1  # ran before returning
    (metrics,) = pending.result()
    expected, norm = hf_reference_step(copy.deepcopy(hf), batch, lr=1e-3)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5) and metrics["lr"] == 1e-3
    for name, tensor in agent.export_hf_weights():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=2e-6, msg=name)
    agent.close()
    agent.close()  # idempotent; nothing outside the process to release
    assert agent.sequence_logprobs(batch)[0].shape == (4,)


def test_a_metric_is_averaged_over_the_micro_batches_that_report_it(tmp_path):
    # micro_batch_size=3 over 4 sequences: micro-batches of 3 and 1; "first" comes only from the first (as a
    # per-pair or per-family key does from micro-batches holding that pair or family), "every" from both
    hf = make_tiny_hf("llama", str(tmp_path / "hf"), seed=5)
    agent = HFAgent("a", copy.deepcopy(hf), lr=1e-3, train_cfg=TrainConfig(micro_batch_size=3))
    seen: list[int] = []

    def loss_fn(lp, inputs, info):
        loss, _ = sft_loss(lp, inputs, info)
        seen.append(len(inputs))
        return loss, {"every": float(len(inputs)), **({"first": 0.5} if len(seen) == 1 else {})}

    (metrics,) = agent.train([sample_batch()], loss_fn)
    assert seen == [3, 1]
    assert metrics["first"] == 0.5  # not diluted by the micro-batch without it (0.5·3/4)
    assert metrics["every"] == (3 * 3 + 1 * 1) / 4  # weighted by each micro-batch's sequences
    agent.close()
