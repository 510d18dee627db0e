"""One MoE agent's router bookkeeping: the aux/z-loss scale for our summed loss, their logged
values, and routing replay, all kept per agent (docs/moe.md).

**Loss scale.** Our training loss is a sum over micro-batches and DP ranks of per-micro-batch losses
already normalised by the mini-batch (agents/local.py), and megatron-core's
``finalize_model_grads`` rescaling by the global token count is skipped. megatron-core attaches
the load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4) and the z-loss (ST-MoE,
Zoph et al. 2022, eq. 5) of every micro-batch multiplied by that micro-batch's token count, expecting
that rescaling. So for each update the coefficients megatron sees are ``coeff / N``, ``N`` the
mini-batch's tokens over all micro-batches and DP ranks (padding included, as the router sees it):
the aux gradient is then ``coeff · Σ_mb (N_mb / N) · ∇aux_mb``, a token-weighted mean, the same
whatever the micro-batching, DP or EP layout. megatron-core 0.16.1 multiplies by the
sequence-parallel shard's token count only (0.19 by the whole micro-batch's), so there the
coefficient is also multiplied by TP (detected from megatron's source, :func:`_scales_by_tp`).

**Logged values.** ``moe/aux_loss`` and ``moe/z_loss`` are the token-weighted means per MoE layer
(raw, without coefficient), taken from this agent's routers only: megatron's own aux-loss tracker
is process-global and sized by the first model that wrote to it.

**Routing replay.** megatron-core's ``RouterReplay`` records / replays each MoE layer's top-k expert
indices; its instance list is process-global (``RouterReplay.global_router_replay_instances``), so
two MoE agents in one process would mix their routers. :class:`RoutingReplay` takes this model's
instances out of that list and drives them itself. Routes are kept per sequence (keyed by its
token ids), gathered over sequence-parallel and data-parallel ranks, because the updates regroup the
π_old pass's sequences into other micro-batches on other ranks. Sequences the agent's π_old pass did
not score (other agents' responses) are scored once before the step's first update, with the same
weights (agents/local.py), so every token of every update replays its π_old experts.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hacrl_megatron.agents.packing import Geometry, round_up


@functools.cache
def _scales_by_tp() -> tuple[bool, bool]:
    """(aux, z): whether megatron-core multiplies the attached loss by the TP·CP size itself (0.19)."""
    from megatron.core.transformer.moe.router import TopKRouter

    aux = "tp_cp_group.size()" in inspect.getsource(TopKRouter.attach_and_log_load_balancing_loss)
    z_src = inspect.getsource(TopKRouter.apply_z_loss)
    return aux, "num_local_tokens * self.tp_cp_group.size()" in z_src


def _reset_megatron_tracker() -> None:
    """Empty megatron-core's process-global aux-loss tracker (entries and their per-layer tensors).

    It is sized by the first model that writes to it, so a second MoE agent with more layers in the
    same process would index past it; every update starts and ends with it empty (we log our own)."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "get_moe_metrics_tracker"):  # megatron-core >= 0.17
        moe_utils.get_moe_metrics_tracker().metrics.clear()
    else:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


def routers(model: torch.nn.Module) -> list[Any]:
    """The model's ``TopKRouter`` modules in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class RouterLosses:
    """Per-update aux/z-loss coefficients and the values megatron computed, for one agent's routers."""

    def __init__(self, model: torch.nn.Module, aux_coeff: float, z_coeff: float, tp: int, world_group: Any) -> None:
        self.config = model.config
        self.aux_coeff, self.z_coeff, self.tp = aux_coeff, z_coeff, tp
        self.group = world_group
        self.layers = self.config.num_layers
        self._sums = torch.zeros(2, dtype=torch.float64)  # Σ N_mb·aux, Σ lse² over this rank's routers
        for router in routers(model):
            self._wrap(router)

    def _wrap(self, router: Any) -> None:
        attach, z_loss = router.attach_and_log_load_balancing_loss, router.apply_z_loss
        sums, tp = self._sums, self.tp

        def attach_and_log(activation: torch.Tensor, aux_loss_coeff: float, aux_loss: torch.Tensor, *args: Any,
                           **kwargs: Any) -> torch.Tensor:
            # raw aux of this rank's tokens (a partial sum over TP under SP) × the micro-batch's tokens
            sums[0] += float(aux_loss.detach() / aux_loss_coeff) * activation.shape[0] * tp
            return attach(activation, aux_loss_coeff, aux_loss, *args, **kwargs)

        def apply_z(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if router.config.moe_z_loss_coeff is not None and router.training and torch.is_grad_enabled():
                with torch.no_grad():
                    sums[1] += float(torch.logsumexp(logits.float(), dim=-1).square().sum())
            return z_loss(logits, *args, **kwargs)

        router.attach_and_log_load_balancing_loss = attach_and_log
        router.apply_z_loss = apply_z

    @contextlib.contextmanager
    def update(self, tokens: int) -> Iterator[dict[str, float]]:
        """Coefficients for one update of ``tokens`` mini-batch tokens; yields the metrics dict that is
        filled with ``moe/aux_loss``, ``moe/z_loss`` (token-weighted means per layer) on exit."""
        aux_by_tp, z_by_tp = _scales_by_tp()
        self.config.moe_aux_loss_coeff = self.aux_coeff / tokens * (1 if aux_by_tp else self.tp)
        self.config.moe_z_loss_coeff = self.z_coeff / tokens * (1 if z_by_tp else self.tp) if self.z_coeff else None
        self._sums.zero_()
        out: dict[str, float] = {}
        _reset_megatron_tracker()
        try:
            yield out
        finally:
            self.config.moe_aux_loss_coeff, self.config.moe_z_loss_coeff = self.aux_coeff, self.z_coeff or None
            _reset_megatron_tracker()
        sums = self._sums.clone()
        if self.group is not None:
            torch.distributed.all_reduce(sums, group=self.group)
        denominator = tokens * self.layers
        if self.aux_coeff:
            out["moe/aux_loss"] = float(sums[0]) / denominator
        if self.z_coeff:
            out["moe/z_loss"] = float(sums[1]) / denominator
        out["moe/aux_loss_coeff"] = self.aux_coeff
        out["moe/z_loss_coeff"] = self.z_coeff


@dataclass(frozen=True)
class MicroLayout:
    """Where one micro-batch's sequences sit in the model input, for the router's ``[T, B]`` grid.

    keys: each sequence's token ids as bytes; lengths: their token counts; t_max: the row length T
    the model sees (padding included); places: per sequence, its (row b, first position) in the grid:
    ``(b, 0)`` for right-padded rows, ``(0, start)`` for a packed row (agents/schedule.py).
    """

    keys: list[bytes]
    lengths: list[int]
    t_max: int
    places: list[tuple[int, int]]

    @property
    def rows(self) -> int:
        return max(b for b, _ in self.places) + 1


def micro_layouts(input_ids: tuple[torch.Tensor, ...], groups: tuple[tuple[int, ...], ...],
                  geometry: Geometry) -> list[MicroLayout]:
    """The :class:`MicroLayout` of each micro-batch ``groups[j]`` (indices into ``input_ids``) as
    agents/schedule.py builds its rows under ``geometry``: a packed row holds each sequence from the end
    of the previous one's slot (its length rounded up to ``seq_multiple``); padded rows one each."""
    out = []
    for idx in groups:
        lengths = [int(input_ids[i].numel()) for i in idx]
        if geometry.packed:
            starts = [sum(round_up(n, geometry.seq_multiple) for n in lengths[:j]) for j in range(len(lengths))]
            places, t_max = [(0, s) for s in starts], geometry.tokens(lengths)
        else:
            places, t_max = [(j, 0) for j in range(len(lengths))], round_up(max(lengths), geometry.row_multiple)
        out.append(MicroLayout([input_ids[i].cpu().numpy().tobytes() for i in idx], lengths, t_max, places))
    return out


class RoutingReplayError(RuntimeError):
    """A training sequence has no recorded routing (it was not scored in this step's π_old pass)."""


class RoutingReplay:
    """Record the top-k experts of every token in no-grad passes; replay them in the updates.

    ``record(micro)`` / ``replay(micro)`` take, per micro-batch in schedule order, its
    :class:`MicroLayout` (each sequence's key, length and place in the padded or packed rows); the schedule's forwards are matched to
    them by forward hooks on the GPTModel (megatron-core runs micro-batches in order on every stage).
    Tensors: recorded indices ``[T_local·B, k]`` per MoE layer of this stage (``T_local`` = T/tp
    under sequence parallelism), stored per sequence as ``[len, k]`` uint8/int16 on the host.
    """

    def __init__(self, model: torch.nn.Module, num_experts: int, tp: int, sequence_parallel: bool, agent: str) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.instances = [r.router_replay for r in routers(model) if getattr(r, "router_replay", None) is not None]
        if not self.instances:
            raise ValueError(f"agent {agent}: routing replay needs a model built with moe_enable_routing_replay")
        ids = {id(i) for i in self.instances}  # out of megatron's process-global list: this agent's alone
        RouterReplay.global_router_replay_instances[:] = [
            i for i in RouterReplay.global_router_replay_instances if id(i) not in ids]
        self.agent, self.tp, self.sp = agent, tp, sequence_parallel and tp > 1
        self.dtype = torch.uint8 if num_experts <= 256 else torch.int16
        self.routes: dict[bytes, list[torch.Tensor]] = {}
        self.version: int | None = None  # the update count the routes were recorded at
        self._queue: list[MicroLayout] = []
        self._mode: str | None = None
        self._topk = 0
        model.register_forward_pre_hook(self._before_forward)
        model.register_forward_hook(self._after_forward)

    # -- hooks ---------------------------------------------------------------------------------
    def _before_forward(self, module: Any, args: Any) -> None:
        if self._mode != "replay":
            return
        layout = self._queue.pop(0)
        for layer, inst in enumerate(self.instances):
            inst.set_target_indices(self._targets(layout, layer))

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        if self._mode != "record":
            return
        layout = self._queue.pop(0)
        per_layer = [self._full_sequence(inst.get_recorded_indices(), layout.rows) for inst in self.instances]
        for key, n, (b, start) in zip(layout.keys, layout.lengths, layout.places):
            self.routes[key] = [idx[start : start + n, b].to(self.dtype).cpu() for idx in per_layer]

    def _full_sequence(self, idx: torch.Tensor, batch: int) -> torch.Tensor:
        """[T_local·B, k] → [T, B, k], gathering the sequence-parallel shards over TP."""
        from megatron.core import parallel_state as mpu

        idx = idx.reshape(-1, batch, idx.shape[-1])
        if not self.sp:
            return idx
        parts = [torch.empty_like(idx) for _ in range(self.tp)]
        torch.distributed.all_gather(parts, idx.contiguous(), group=mpu.get_tensor_model_parallel_group())
        return torch.cat(parts)

    def _targets(self, layout: MicroLayout, layer: int) -> torch.Tensor:
        from megatron.core import parallel_state as mpu

        k = self._topk
        # padding positions get experts 0..k-1: they reach the aux loss only, never a real token
        out = torch.arange(k).expand(layout.t_max, layout.rows, k).clone()
        for key, n, (b, start) in zip(layout.keys, layout.lengths, layout.places):
            if key not in self.routes:
                raise RoutingReplayError(
                    f"agent {self.agent}: routing replay has no recorded experts for a training sequence of "
                    f"{n} tokens: every sequence of the updates must be scored in the step's π_old pass first")
            out[start : start + n, b] = self.routes[key][layer].long()
        if self.sp:
            r, chunk = mpu.get_tensor_model_parallel_rank(), layout.t_max // self.tp
            out = out[r * chunk : (r + 1) * chunk]
        return out.reshape(-1, k)

    # -- record / replay -----------------------------------------------------------------------
    @contextlib.contextmanager
    def record(self, micro: list[MicroLayout], version: int, dp_group: Any) -> Iterator[None]:
        """Record the routes of the ``micro``-batches run inside the block (weights at update ``version``)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.version != version:  # routes of older weights are never replayed
            self.routes, self.version = {}, version
        before = set(self.routes)
        with self._acting(RouterReplayAction.RECORD, "record", micro):
            yield
        if dp_group is not None and torch.distributed.get_world_size(dp_group) > 1:
            mine = {k: v for k, v in self.routes.items() if k not in before}
            gathered: list[Any] = [None] * torch.distributed.get_world_size(dp_group)
            torch.distributed.all_gather_object(gathered, mine, group=dp_group)
            for part in gathered:
                self.routes.update(part)

    @contextlib.contextmanager
    def replay(self, micro: list[MicroLayout], version: int) -> Iterator[None]:
        """Replay the recorded routes in the forwards of the block (a training update)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.version is None or not self.routes:
            raise RoutingReplayError(f"agent {self.agent}: routing replay is on but no π_old pass recorded routes "
                                     "before this update")
        self._topk = next(iter(self.routes.values()))[0].shape[-1]
        with self._acting(RouterReplayAction.REPLAY_FORWARD, "replay", micro):
            yield

    def clear(self) -> None:
        """Forget the recorded routes (after the step's updates)."""
        self.routes, self.version = {}, None

    @contextlib.contextmanager
    def _acting(self, action: Any, mode: str, micro: list) -> Iterator[None]:
        self._queue, self._mode = list(micro), mode
        for inst in self.instances:
            inst.set_router_replay_action(action)
        try:
            yield
        finally:
            self._mode, self._queue = None, []
            for inst in self.instances:
                inst.clear_router_replay_action()
                inst.clear_indices()
