"""``LocalAgent``: an :class:`~hacrl_megatron.agents.handle.AgentHandle` over megatron-core in this process.

Every rank of the agent's world constructs one ``LocalAgent`` and makes the same calls (SPMD); in
the CPU demo the world is the controller process itself (TP = PP = DP = 1), and several agents
share it because they share megatron's parallel state of sizes 1 (docs/architecture.md, "local" mode).

Training (docs/algorithm.md §7): for each mini-batch m the sequences are split over data-parallel ranks, then
into micro-batches of ``train_cfg.micro_batch_size`` sequences; ``loss_fn`` returns each micro-batch's
loss already divided by the mini-batch's global sequence count, and gradients are **summed** over
micro-batches and DP ranks (``calculate_per_token_loss=True`` turns off megatron's division by the
number of micro-batches and its DP averaging; :func:`_finalize_grads` skips the token rescaling),
so the update equals the full mini-batch gradient. Context-parallel ranks each run their chunks of
every row and assemble the full log-probs (agents/context_parallel.py); their gradients are summed
too. Then grad clipping, the LR schedule and AdamW.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from typing import Any

import torch

from hacrl_megatron.agents import checkpoint as ckpt
from hacrl_megatron.agents.batch import LogProbOutput, LossFn, SequenceBatch, mean_over_micro_batches
from hacrl_megatron.agents.context_parallel import split_for_context_parallel
from hacrl_megatron.agents.ddp import ddp_config, gather_updated_params, wire_overlap
from hacrl_megatron.agents.handle import CompletedResult
from hacrl_megatron.agents.lm_head import build_lm_head
from hacrl_megatron.agents.moe import MicroLayout, RouterLosses, RoutingReplay, micro_layouts
from hacrl_megatron.agents.offload import Offloadable
from hacrl_megatron.agents.packing import (
    MicroBatchPlan,
    count_micro_batches,
    geometry_for,
    plan_micro_batches,
)
from hacrl_megatron.agents.reference import ReferenceWeights, WeightVersions, missing_reference
from hacrl_megatron.agents.schedule import MicroBatch, pad_rows, plan_micro_batches_of, run_schedule
from hacrl_megatron.config import AgentConfig, ConfigError, TrainConfig
from hacrl_megatron.config.validation_scale import require_context_parallel
from hacrl_megatron.models import convert
from hacrl_megatron.models.cpu_compat import enable_cpu_compat
from hacrl_megatron.models.export import export_hf_weights, export_stage_hf_weights
from hacrl_megatron.models.hf_io import is_hf_dir
from hacrl_megatron.models.moe import MoESettings
from hacrl_megatron.models.parallel import init_parallel
from hacrl_megatron.models.provider import build_gpt_model, use_transformer_engine
from hacrl_megatron.models.resolved import ResolvedAgent, agent_inputs


def _finalize_grads(model_chunks: list, num_tokens: Any = None, *args: Any, **kwargs: Any) -> None:
    """megatron's ``finalize_model_grads`` (DP all-reduce, tied-embedding sync) without 1/num_tokens."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model_chunks, None)


def _experts_in_expert_buffers(model: Any) -> None:
    """Expert weights reduced over the expert-data-parallel group at EP = 1 too, as megatron-core does
    only at EP > 1 (``allreduce=False``). At EP = 1 with ETP = TP that group holds the same ranks as
    data parallelism, so the gradients are the same; the optimizer is then always megatron's chained
    dense + expert optimizer, whose checkpoint loads at any EP (a plain one's does not)."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


class LocalAgent(Offloadable, ckpt.MegatronCheckpointing):  # save, begin_save / end_save, load
    """One Megatron agent driven in-process (see module docstring); ``sleep``/``wake``: agents/offload.py.

    Args:
        agent_cfg: name, model, parallel, lr, init_checkpoint.
        train_cfg: micro_batch_size, grad_clip, weight_decay, adam_beta1/2, lr_warmup_steps,
            lr_schedule, seed.
        vocab_size: tokenizer vocabulary for models built from sizes (``model.vocab_size`` None).
        hf_checkpoint: HF weights to start from: a directory, or an HF-named state dict; default
            ``agent_cfg.model.hf_path``'s weights, else ``agent_cfg.init_checkpoint`` (HF dir or Megatron
            checkpoint from :meth:`save`), else megatron's random init (std 0.02).
        hf_config: the HF config of the model (overrides ``agent_cfg.model``; see :meth:`from_hf_model`).
        resolved: the run's record of this agent (models/resolved.py): its spec and config, read once.
        logprob_impl: "auto" | "reference" | "triton": ``hacrl_megatron.kernels.sequence_logprobs``
            from hidden states (no [N, V] logits; "auto" = Triton on CUDA, torch reference on CPU),
            with or without sequence parallelism; "megatron": logits + megatron's
            ``vocab_parallel_cross_entropy`` (agents/logprob_path.py).
        total_updates: optimizer updates of the whole run (cosine decay length); default
            ``train_cfg.steps * train_cfg.mini_batches``.
    """

    def __init__(self, agent_cfg: AgentConfig, train_cfg: TrainConfig, *, vocab_size: int | None = None,
                 hf_checkpoint: Any = None, hf_config: Any = None, total_updates: int | None = None,
                 logprob_impl: str = "auto", resolved: ResolvedAgent | None = None) -> None:
        self.name = agent_cfg.name
        self.train_cfg = train_cfg
        par = agent_cfg.parallel
        init_sub = agent_cfg.init_checkpoint
        if hf_checkpoint is None and init_sub is not None and is_hf_dir(init_sub):
            hf_checkpoint, init_sub = init_sub, None
        require_context_parallel(par.cp, f"agent {self.name!r}: parallel.cp")  # API users skip validation
        self.spec, self.hf_config, source = agent_inputs(agent_cfg, vocab_size, hf_checkpoint, hf_config, resolved)
        self.info = init_parallel(par.tp, par.pp, par.dp, seed=train_cfg.seed, ep=par.ep, etp=par.etp, cp=par.cp)
        self.sequence_parallel = par.sequence_parallel and par.tp > 1
        self.geometry = geometry_for(train_cfg.pack_sequences, par.tp, self.sequence_parallel, par.cp)
        moe = MoESettings.from_model_config(agent_cfg.model) if self.spec.is_moe else None
        model = build_gpt_model(self.spec, par.tp, par.pp, ep=par.ep, etp=par.etp,
                                sequence_parallel=par.sequence_parallel, recompute=par.recompute, moe=moe, cp=par.cp)
        if source is not None:
            convert.load_hf_weights(model, self.spec, source)
        self._router_losses, self._replay = self._moe_bookkeeping(model, moe, par.tp)
        self.head = build_lm_head(model, logprob_impl, vocab_size=self.spec.vocab_size, tp=par.tp,
                                  sequence_parallel=par.sequence_parallel)
        self.model, self.optimizer, self.scheduler = self._build_training(model, agent_cfg, train_cfg, total_updates)
        self.updates = 0
        self._stats: dict[str, float] = {}
        if init_sub is not None:
            ckpt.load_checkpoint(init_sub, convert.unwrap(self.model), self.optimizer, self.scheduler, self.spec,
                                 with_optimizer=False)

    def _moe_bookkeeping(self, model: Any, moe: MoESettings | None, tp: int) -> tuple[Any, Any]:
        """This agent's router losses and routing replay (agents/moe.py); (None, None) for dense models."""
        if moe is None:
            return None, None
        if moe.routing_replay and self.info.cp > 1:  # API users skip validation's rule
            raise ConfigError(f"agent {self.name!r}: model.moe_routing_replay=True: not with parallel.cp={self.info.cp}")
        group = torch.distributed.group.WORLD if self.info.world_size > 1 else None
        # megatron's router reduces over the tp·cp group: each rank's aux loss is a share of that group's
        losses = RouterLosses(model, moe.aux_loss_coeff, moe.z_loss_coeff, tp * self.info.cp, group)
        replay = RoutingReplay(model, self.spec.num_experts, tp, self.sequence_parallel, self.name) \
            if moe.routing_replay else None
        return losses, replay

    @classmethod
    def from_hf_model(cls, agent_cfg: AgentConfig, hf_model: Any, *, train_cfg: TrainConfig,
                      total_updates: int | None = None) -> LocalAgent:
        """An agent initialised from an in-memory transformers causal LM (its config and weights)."""
        state = {k: v.detach() for k, v in hf_model.state_dict().items()}
        return cls(agent_cfg, train_cfg, hf_checkpoint=state, hf_config=hf_model.config, total_updates=total_updates)

    # ----------------------------------------------------------------------------------------
    def _build_training(self, model: Any, agent_cfg: AgentConfig, train_cfg: TrainConfig,
                        total_updates: int | None) -> tuple:
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        config = model.config
        config.finalize_model_grads_func = _finalize_grads
        if self.spec.is_moe:
            _experts_in_expert_buffers(model)
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config(agent_cfg.parallel), module=model)
        wire_overlap(ddp, config)
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=agent_cfg.lr, min_lr=0.0 if train_cfg.lr_schedule == "cosine" else agent_cfg.lr,
            weight_decay=train_cfg.weight_decay, adam_beta1=train_cfg.adam_beta1, adam_beta2=train_cfg.adam_beta2,
            adam_eps=1e-8, clip_grad=train_cfg.grad_clip,
            use_distributed_optimizer=agent_cfg.parallel.use_distributed_optimizer,
            bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype,
        )
        optimizer = get_megatron_optimizer(opt_cfg, [ddp])
        total = max(1, total_updates if total_updates is not None else train_cfg.steps * train_cfg.mini_batches)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=agent_cfg.lr, min_lr=opt_cfg.min_lr, lr_warmup_steps=train_cfg.lr_warmup_steps,
            lr_decay_steps=max(total, train_cfg.lr_warmup_steps + 1), lr_decay_style=train_cfg.lr_schedule,
            start_wd=train_cfg.weight_decay, end_wd=train_cfg.weight_decay, wd_incr_steps=total, wd_incr_style="constant",
        )
        return ddp, optimizer, scheduler

    @property
    def module(self) -> Any:
        """The bare ``GPTModel`` of this rank's pipeline stage."""
        return convert.unwrap(self.model)

    def _plan(self, batch: SequenceBatch) -> MicroBatchPlan:
        """Which sequences each DP rank runs in which micro-batch: consecutive groups of
        ``train.micro_batch_size``, or the token budget's plan (agents/packing.py); the same on every rank."""
        budget = self.train_cfg.max_tokens_per_microbatch
        if budget <= 0:
            return count_micro_batches(len(batch), self.train_cfg.micro_batch_size, self.info.dp)
        return plan_micro_batches([int(ids.numel()) for ids in batch.input_ids], self.info.dp, budget, self.geometry)

    def _split(self, batch: SequenceBatch, plan: MicroBatchPlan | None = None) -> list[MicroBatch]:
        top = max(int(ids.max()) for ids in batch.input_ids)
        if top >= self.spec.vocab_size or min(int(ids.min()) for ids in batch.input_ids) < 0:
            raise ValueError(f"agent {self.name}: token ids must lie in [0, vocab_size={self.spec.vocab_size}); "
                             f"batch has max id {top} (tokenizer and model vocabularies differ?)")
        plan = plan or self._plan(batch)
        self._split_tokens = plan.tokens([int(ids.numel()) for ids in batch.input_ids], self.geometry)
        thd = self.geometry.packed and use_transformer_engine()
        micro = plan_micro_batches_of(batch, plan, self.info.dp_rank, self.geometry, self._device(), thd)
        micro = [pad_rows(mb, self.geometry.row_multiple) for mb in micro]
        return split_for_context_parallel(micro, self.info.cp, self.info.cp_rank)  # as is at cp = 1

    def _micro_layout(self, batch: SequenceBatch, dp_rank: int) -> list[MicroLayout]:
        """Per micro-batch of DP rank ``dp_rank``, as :meth:`_split` forms them: where its sequences sit."""
        return micro_layouts(batch.input_ids, self._plan(batch).ranks[dp_rank], self.geometry)

    def _mini_batch_tokens(self, batch: SequenceBatch) -> int:
        """Tokens the routers see in one update: every micro-batch's row tokens (padding included) over
        every DP rank."""
        lengths = [int(ids.numel()) for ids in batch.input_ids]
        return self._plan(batch).tokens(lengths, self.geometry)[1]

    def _device(self) -> torch.device:
        return next(self.module.parameters()).device

    def _reports(self) -> bool:
        """This rank contributes results (last pipeline stage, TP rank 0, CP rank 0: every CP rank holds
        the same assembled log-probs; one per DP replica)."""
        from megatron.core import parallel_state as mpu

        return mpu.is_pipeline_last_stage() and self.info.tp_rank == 0 and self.info.cp_rank == 0

    # ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def token_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> LogProbOutput:
        """No-grad per-token log π of the response tokens, packed (:class:`LogProbOutput`), on every rank.

        Each DP replica's last stage (TP and CP rank 0) fills its slice of the sequences; one all-reduce
        over the agent's world assembles the batch on every rank. A batch smaller than DP (the
        post-sync probe is one sequence) is padded with copies of its last sequence: every replica
        runs a forward (expert parallelism's all-to-all needs all of them).
        """
        enable_cpu_compat()
        n = len(batch)
        if n < self.info.dp:
            out = self.token_logprobs(batch.select(list(range(n)) + [n - 1] * (self.info.dp - n)), temperature)
            return LogProbOutput(token_logps=out.token_logps[: int(out.cu_seqlens[n])], cu_seqlens=out.cu_seqlens[: n + 1],
                                 seq_logp_sum=out.seq_logp_sum[:n], seq_len=out.seq_len[:n])
        t0 = time.perf_counter()
        lens = batch.response_lens
        cu = torch.zeros(len(batch) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(lens, 0)
        n_tok = int(cu[-1])
        flat = torch.zeros(n_tok + len(batch), dtype=torch.float32, device=self._device())  # [tokens | sums]
        reports = self._reports()

        def collect(lp: LogProbOutput, mb: MicroBatch) -> torch.Tensor:
            if reports and not mb.filler:  # each sequence's log-probs to its place in the batch
                token_logps, seq_sums = lp.token_logps.detach().float(), lp.seq_logp_sum.detach().float()
                for j, i in enumerate(mb.seq_index.tolist()):
                    flat[int(cu[i]) : int(cu[i + 1])] = token_logps[int(lp.cu_seqlens[j]) : int(lp.cu_seqlens[j + 1])]
                    flat[n_tok + i] = seq_sums[j]
            return lp.seq_logp_sum.sum() * 0

        micro = self._split(batch)
        self.model.eval()
        with self._recording_routes(batch):
            run_schedule(self.model, micro, collect, temperature, self.head, forward_only=True)
        self.model.train()
        if self.info.world_size > 1:
            torch.distributed.all_reduce(flat)
        flat = flat.cpu()
        self._stats["logprob_tokens_per_s"] = batch.num_tokens() / max(time.perf_counter() - t0, 1e-9)
        return LogProbOutput(token_logps=flat[:n_tok], cu_seqlens=cu, seq_logp_sum=flat[n_tok:], seq_len=lens)

    def _recording_routes(self, batch: SequenceBatch) -> Any:
        """Routing replay: a no-grad pass of the live weights records every sequence's experts (the
        π_old pass); the KL reference's pass does not (its weights are not the policy's)."""
        if self._replay is None or getattr(self, "_in_reference_pass", False):
            return contextlib.nullcontext()
        from megatron.core import parallel_state as mpu

        group = mpu.get_data_parallel_group() if self.info.dp > 1 else None
        return self._replay.record(self._micro_layout(batch, self.info.dp_rank), self.updates, group)

    def keep_version(self, version: int) -> None:
        """Snapshot the live weights as ``version`` (agents/reference.WeightVersions)."""
        self._versions().keep(version)

    def drop_versions(self, below: int) -> None:
        self._versions().drop_below(below)

    def sequence_logprobs_at(self, version: int, batch: SequenceBatch,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sequence_logprobs` under the weights of snapshot ``version``."""
        self._in_reference_pass = True  # not the live policy: records no routes
        try:
            return self._versions().run(version, lambda: self.sequence_logprobs(batch, temperature))
        finally:
            self._in_reference_pass = False

    def _versions(self) -> WeightVersions:
        if getattr(self, "_weight_versions", None) is None:
            self._weight_versions = WeightVersions(self.name, lambda: self.module.parameters())
        return self._weight_versions

    def keep_reference(self) -> None:
        """Keep this rank's current weight shard (host copy) as the KL penalty's frozen reference
        (agents/reference.py); on every rank."""
        self._reference = ReferenceWeights(self.module.parameters())

    def reference_token_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> LogProbOutput:
        """:meth:`token_logprobs` under the weights :meth:`keep_reference` kept; on every rank."""
        if getattr(self, "_reference", None) is None:
            raise missing_reference(self.name)
        self._in_reference_pass = True
        try:
            return self._reference.run(lambda: self.token_logprobs(batch, temperature))
        finally:
            self._in_reference_pass = False

    def sequence_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Σ log π of each response [S] (float32, at ``temperature``) and its token count [S]; on every rank."""
        out = self.token_logprobs(batch, temperature)
        return out.seq_logp_sum, out.seq_len

    def train(self, mini_batches: list[SequenceBatch], loss_fn: LossFn, temperature: float = 1.0) -> list[dict[str, float]]:
        """One optimizer update per mini-batch, m = 0..M-1 in order; one metrics dict per update
        (mean of ``loss_fn``'s metrics over micro-batches, plus ``loss``, ``grad_norm``, ``lr``)."""
        enable_cpu_compat()
        out, t0, tokens = [], time.perf_counter(), 0
        if self._replay is not None:
            self._record_missing_routes(mini_batches)
        real = run = 0
        for m, mini in enumerate(mini_batches):
            out.append(self._update(m, mini, loss_fn, temperature))
            tokens += mini.num_tokens()
            real, run = real + self._split_tokens[0], run + self._split_tokens[1]
        gather_updated_params(self.model)  # what runs next (weight sync, save) reads the parameters
        self._stats["pad_fraction"] = 1.0 - real / max(run, 1)  # over the updates' micro-batches
        if self._replay is not None:  # the step's π_old routes are used up
            self._replay.clear()
        self._stats["train_tokens_per_s"] = tokens / max(time.perf_counter() - t0, 1e-9)
        return out

    def _record_missing_routes(self, mini_batches: list[SequenceBatch]) -> None:
        """Routing replay: the step's sequences that no π_old pass of this agent scored (the other
        agents' responses: HACPO's cross ratio uses their authors' π_old) get their experts from one
        no-grad pass now, before the first update, under the same π_old weights. Every rank finds the
        same sequences (the routes are gathered over the agent's world)."""
        known = self._replay.routes if self._replay.version == self.updates else {}
        missing: dict[bytes, tuple[torch.Tensor, int]] = {}
        for mini in mini_batches:
            for ids, p in zip(mini.input_ids, mini.prompt_lens.tolist()):
                key = ids.cpu().numpy().tobytes()
                if key not in known:
                    missing.setdefault(key, (ids, int(p)))
        if not missing:
            return
        seqs = list(missing.values())
        batch = SequenceBatch(input_ids=tuple(ids for ids, _ in seqs), prompt_lens=torch.tensor([p for _, p in seqs]))
        self.token_logprobs(batch)
        self._stats["routing_replay_extra_sequences"] = float(len(missing))

    def train_async(self, mini_batches: list[SequenceBatch], loss_fn: LossFn,
                    temperature: float = 1.0) -> CompletedResult[list[dict[str, float]]]:
        """:meth:`train`, run now (this process is the agent's world): an already-completed result."""
        return CompletedResult(self.train(mini_batches, loss_fn, temperature))

    def _update(self, m: int, mini: SequenceBatch, loss_fn: LossFn, temperature: float) -> dict[str, float]:
        info = mini.info(m)  # the whole mini-batch, before the data-parallel split
        records: list[tuple[float, dict[str, float]]] = []

        def step_loss(lp: LogProbOutput, mb: MicroBatch) -> torch.Tensor:
            loss, metrics = loss_fn(lp, mb.loss_inputs, info)
            if mb.filler:  # a repeated sequence that only keeps the ranks' micro-batch counts equal
                return loss * 0
            records.append((float(loss.detach()), dict(metrics), len(mb.seq_len)))
            return loss

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        with self._moe_update(mini) as moe_metrics:
            run_schedule(self.model, self._split(mini), step_loss, temperature, self.head, forward_only=False)
        self.scheduler.step(increment=1)  # lr of update u: schedule at u+1 (warm-up never starts at 0)
        lr = float(self.optimizer.param_groups[0]["lr"])
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError(f"agent {self.name}: optimizer step {self.updates} skipped (inf/nan gradients)")
        self.updates += 1
        metrics = self._reduce_metrics(records if self._reports() else [])
        metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), lr=lr, **moe_metrics)
        return metrics

    @contextlib.contextmanager
    def _moe_update(self, mini: SequenceBatch) -> Iterator[dict[str, float]]:
        """An MoE update: router loss coefficients for this mini-batch's tokens (agents/moe.py) and the
        replayed routes; yields the ``moe/*`` metrics (filled on exit). Nothing for dense models."""
        if self._router_losses is None:
            yield {}
            return
        with contextlib.ExitStack() as stack:
            metrics = stack.enter_context(self._router_losses.update(self._mini_batch_tokens(mini)))
            if self._replay is not None:
                stack.enter_context(self._replay.replay(self._micro_layout(mini, self.info.dp_rank), self.updates))
            yield metrics

    def _reduce_metrics(self, records: list[tuple[float, dict[str, float], int]]) -> dict[str, float]:
        """loss: sum over all micro-batches (the mini-batch loss); other metrics: mean over the micro-batches
        weighted by their sequences (a per-sequence mean, whatever the micro-batching)."""
        if self.info.world_size > 1:
            gathered: list[Any] = [None] * self.info.world_size
            torch.distributed.all_gather_object(gathered, records)
            records = [r for part in gathered for r in part]
        return {"loss": sum(r[0] for r in records), **mean_over_micro_batches([(md, n) for _, md, n in records])}

    # ----------------------------------------------------------------------------------------
    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors (gathered across TP/PP), streamed one at a time, on every rank."""
        enable_cpu_compat()
        return export_hf_weights(self.module, self.spec)

    def export_stage_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's pipeline stage's share of them, on that stage only (a stage sender's stream)."""
        enable_cpu_compat()
        return export_stage_hf_weights(self.module, self.spec)

    def stats(self) -> dict[str, float]:
        """tokens/s of the last train and logprob calls; peak RSS (MiB) and CUDA memory (MiB)."""
        out = dict(self._stats)
        out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        if torch.cuda.is_available():
            out["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
        out["updates"] = float(self.updates)
        return out

    def num_parameters(self) -> int:
        """Parameters of the whole model as HF counts them (unpadded vocab, all stages)."""
        return self.spec.num_parameters()

    def close(self) -> None:
        """Nothing to release: the model lives in this process and goes with the object."""

