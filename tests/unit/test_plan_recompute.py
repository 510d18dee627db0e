"""Activation recompute modes the planner proposes (``parallel.recompute``) build and train on CPU:
the same loss and gradients as without recompute (recompute changes memory, never values)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from hacrl_megatron.models.parallel import init_parallel  # noqa: E402
from hacrl_megatron.models.provider import (  # noqa: E402
    ParallelLayoutError,
    arch_from_hf,
    build_gpt_model,
    transformer_config,
)
from tests.distributed.megatron_helpers import tiny_hf_config  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _loss_and_grads(recompute: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    spec = arch_from_hf(tiny_hf_config("qwen3"))
    model = build_gpt_model(spec, recompute=recompute)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    tokens = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(12).expand(2, 12)
    # no attention mask, as the agents run it: megatron then makes its default causal mask with
    # device="cuda", also when full recompute re-runs attention inside the backward pass
    logits = model(tokens, pos, attention_mask=None)
    loss = logits.float().logsumexp(-1).mean()
    torch.autograd.backward(loss)  # as megatron schedules do (Tensor.backward would leave the CPU device mode)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_recompute_modes_give_identical_gradients():
    torch.set_num_threads(1)
    init_parallel(1, 1, 1)
    ref_loss, ref_grads = _loss_and_grads("none")
    for mode in ("selective", "full"):
        loss, grads = _loss_and_grads(mode)
        assert torch.equal(loss, ref_loss), mode
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=0, msg=f"{mode}: {name}")


def test_recompute_config_fields():
    spec = arch_from_hf(tiny_hf_config("llama"))
    full = transformer_config(spec, recompute="full")
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    assert transformer_config(spec, recompute="selective").recompute_granularity == "selective"
    assert transformer_config(spec).recompute_granularity is None
    with pytest.raises(ParallelLayoutError, match="recompute='some'"):
        transformer_config(spec, recompute="some")
