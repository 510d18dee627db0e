"""Megatron → HF export, streamed one parameter at a time: the whole model, or one pipeline stage's share.

:func:`export_hf_weights` is what a checkpoint export and the rank-0 weight push read: the owning
stage gathers each parameter's TP shards, turns them into HF tensors (full size, unpadded vocab,
``models/convert.py``'s rules) and broadcasts them over the pipeline group, so every rank of the
agent yields the whole ``(hf_name, tensor)`` stream.

:func:`export_stage_hf_weights` is what a pipeline stage's weight sender reads (``sync/stages.py``):
the same tensors, bit for bit, but each rank yields only the parameters its own stage holds, with no
pipeline broadcast. Every HF tensor has exactly one owning stage (the embedding on the first, the
final norm and an untied LM head on the last, each layer on the stage that holds it; a tied LM head
is the embedding and is not exported twice), so the stages' streams together are the whole state
dict and no trainer rank sees more than its own stage's share of the bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hacrl_megatron.config.layout import pipeline_layers
from hacrl_megatron.models.convert import _LAYER, _to_hf, hf_shape, layer_offset, plan_for, unwrap
from hacrl_megatron.models.convert_moe import expand_expert_suffixes, local_expert_suffix
from hacrl_megatron.models.provider import DTYPES, ArchSpec

__all__ = ["export_hf_weights", "export_order", "export_stage_hf_weights"]


def export_order(spec: ArchSpec, model: Any, pp: int, ep: int = 1) -> list[tuple[int, str, int | None]]:
    """(owning pipeline stage, stage-local Megatron name, global expert or None) for every exported
    parameter, in HF order; an expert's name carries its expert-local index on its owning EP rank."""
    split = pipeline_layers(spec.num_layers, pp)
    own = [n for n, _ in unwrap(model).named_parameters()]
    first = min(int(m.group(1)) for m in map(_LAYER.match, own) if m)
    layer_suffixes = [m.group(2) for m in map(_LAYER.match, own) if m and int(m.group(1)) == first]
    per_layer = expand_expert_suffixes(spec, layer_suffixes, ep)
    order: list[tuple[int, str, int | None]] = [(0, "embedding.word_embeddings.weight", None)]
    for stage, count in enumerate(split):
        for i in range(count):
            order += [(stage, f"decoder.layers.{i}.{local_expert_suffix(s, e, spec, ep)}", e) for s, e in per_layer]
    order.append((pp - 1, "decoder.final_layernorm.weight", None))
    if not spec.tie_embeddings:
        order.append((pp - 1, "output_layer.weight", None))
    return order


def _gather(local: torch.Tensor, size: int, group: Any) -> list[torch.Tensor]:
    """The ``size`` shards of ``local`` over ``group``, in rank order (no copy when size is 1)."""
    import torch.distributed as dist

    if size == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


@torch.no_grad()
def _export(model: Any, spec: ArchSpec, own_stage_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    tp, pp = mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()
    ep = mpu.get_expert_model_parallel_world_size() if spec.is_moe else 1
    etp = mpu.get_expert_tensor_parallel_world_size() if spec.is_moe else 1
    ep_rank = mpu.get_expert_model_parallel_rank() if spec.is_moe else 0
    stage = mpu.get_pipeline_model_parallel_rank()
    params = dict(unwrap(model).named_parameters())
    device = next(iter(params.values())).device
    dtype = DTYPES[spec.dtype]
    for owner, name, expert in export_order(spec, model, pp, ep):
        if own_stage_only and owner != stage:
            continue  # another stage's sender sends it
        holder = 0 if expert is None else expert // (spec.num_experts // ep)  # EP rank holding the expert
        plan = plan_for(spec, name, layer_offset(spec, owner, pp), holder * (spec.num_experts // ep))
        if owner == stage and (expert is None or holder == ep_rank):
            local = params[name].detach()
            if plan.split == "etp":
                shards = _gather(local, etp, mpu.get_expert_tensor_parallel_group() if etp > 1 else None)
            else:
                shards = _gather(local, tp, mpu.get_tensor_model_parallel_group() if tp > 1 else None)
            tensors = [t.to(dtype) for t in _to_hf(spec, plan, shards)]  # no copy when already `dtype`
            del shards, local  # the gathered copies must not live on while the consumer holds the output
        else:
            tensors = [torch.empty(hf_shape(spec, n), dtype=dtype, device=device) for n in plan.hf_names]
        for hf_name, tensor in zip(plan.hf_names, tensors):
            if expert is not None and ep > 1 and owner == stage:
                dist.broadcast(tensor, group=mpu.get_expert_model_parallel_group(), group_src=holder)
            if pp > 1 and not own_stage_only:
                dist.broadcast(tensor, group=mpu.get_pipeline_model_parallel_group(), group_src=owner)
            yield hf_name, tensor


def export_hf_weights(model: Any, spec: ArchSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the whole model, one parameter at a time, on every rank.

    Collective over the agent's TP, PP (and, for MoE, expert) groups: every rank of the agent must
    iterate the stream to the end in step. Tensors are fresh (not views of parameters), on this
    rank's device, with the HF (unpadded) vocabulary, all in the checkpoint dtype ``spec.dtype``:
    megatron-core keeps some parameters in float32 whatever ``params_dtype`` says (the RMSNorm
    weights of the local spec), and a bfloat16 checkpoint must come back bfloat16 in every tensor,
    as its config says. An expert is gathered over ETP on its EP rank, then broadcast over EP.
    """
    return _export(model, spec, own_stage_only=False)


def export_stage_hf_weights(model: Any, spec: ArchSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the parameters of this rank's pipeline stage only, in HF
    order, with the tensors :func:`export_hf_weights` yields for them (same dtype, bit for bit).

    Collective over the stage's TP (and expert) groups only, never across stages: every rank of a
    stage iterates its stage's stream in step, and the stages run independently of each other (a
    stage's sender pushes while the other stages push theirs). A rank holds at most one parameter's
    gathered HF tensors at a time, and over the stream its stage's share of the model's bytes.
    """
    return _export(model, spec, own_stage_only=True)
