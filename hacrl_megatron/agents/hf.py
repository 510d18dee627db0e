"""HFAgent: an AgentHandle over a plain transformers causal LM with torch AdamW.

No Megatron: one process, no model parallelism. It serves quick CPU runs of models the Megatron
provider does not cover, and it is the reference that the Megatron agent's log-probs and updates
are checked against (same HF weights in, same numbers out).
"""

from __future__ import annotations

import copy
import io
import math
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hacrl_megatron.agents.batch import LogProbOutput, LossFn, SequenceBatch, mean_over_micro_batches
from hacrl_megatron.agents.checkpoint_io import (
    BackgroundWrite,
    FileDigest,
    HashingWriter,
    read_verified,
    write_bytes,
)
from hacrl_megatron.agents.handle import CompletedResult
from hacrl_megatron.agents.offload import Offloadable
from hacrl_megatron.agents.packing import Geometry, count_micro_batches, plan_micro_batches
from hacrl_megatron.agents.padding import pack_row, pad_right, response_logprobs_from_logits
from hacrl_megatron.agents.reference import ReferenceWeights, WeightVersions, missing_reference
from hacrl_megatron.config import TrainConfig


def lr_multiplier(update: int, warmup: int, total: int, schedule: str) -> float:
    """Linear warm-up over ``warmup`` updates, then constant or cosine decay to 0 at ``total``."""
    if warmup > 0 and update < warmup:
        return (update + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _unaliased(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the names of tensors stored under an earlier name too (a tied LM head shares
    the embedding's storage; safetensors refuses shared tensors, and loading the embedding fills both)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


def _write_hf_checkpoint(folder: Path, weights: dict[str, torch.Tensor], extra: dict[str, Any], config_json: str,
                         abort: Any) -> dict[str, FileDigest]:
    """The HFAgent's files, each hashed as it is written (agents/checkpoint_io.py): its digests."""
    from safetensors.torch import save as safetensors_bytes

    blob = safetensors_bytes({k: v.contiguous() for k, v in weights.items()}, metadata={"format": "pt"})
    digests = {"hf/model.safetensors": write_bytes(folder / "hf" / "model.safetensors", blob, abort),
               "hf/config.json": write_bytes(folder / "hf" / "config.json", config_json.encode(), abort)}
    with HashingWriter(folder / "optimizer.pt", abort) as f:
        torch.save(extra, f)
    digests["optimizer.pt"] = f.digest
    return digests


class HFAgent(Offloadable):
    """Trains ``model`` (a transformers ``PreTrainedModel``) with AdamW on SequenceBatches.

    Args:
        name: the agent's name (``agents.N.name``).
        model: the model, trained in place.
        lr: AdamW learning rate (``agents.N.lr``).
        train_cfg: micro_batch_size, grad_clip, weight_decay, adam_beta1/2, lr_warmup_steps,
            lr_schedule; None: :class:`~hacrl_megatron.config.TrainConfig`'s defaults.
        total_updates: optimizer updates of the whole run (the cosine schedule's length).
    """

    def __init__(self, name: str, model: Any, *, lr: float, train_cfg: TrainConfig | None = None,
                 total_updates: int = 1) -> None:
        t = train_cfg if train_cfg is not None else TrainConfig()
        self.name = name
        self.model = model
        self.micro_batch_size = t.micro_batch_size
        self.max_tokens_per_microbatch = t.max_tokens_per_microbatch
        self.geometry = Geometry(packed=t.pack_sequences)
        self.grad_clip = t.grad_clip
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(t.adam_beta1, t.adam_beta2),
                                           weight_decay=t.weight_decay)
        self.base_lr = lr
        self._schedule = (t.lr_warmup_steps, total_updates, t.lr_schedule)
        self.updates = 0
        self._stats: dict[str, float] = {}
        self._pending_save: BackgroundWrite | None = None

    # ---- forward ---------------------------------------------------------------------------
    def _logprobs(self, batch: SequenceBatch, temperature: float) -> LogProbOutput:
        if self.geometry.packed:  # one row, positions restarting per sequence, a block-diagonal mask
            dtype = next(self.model.parameters()).dtype
            input_ids, position_ids, mask, starts = pack_row(batch, dtype if dtype.is_floating_point else torch.float32)
            logits = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask).logits
            return response_logprobs_from_logits(logits, batch, temperature, starts)
        input_ids, mask = pad_right(batch)
        logits = self.model(input_ids=input_ids, attention_mask=mask).logits
        return response_logprobs_from_logits(logits, batch, temperature)

    def _micro_batches(self, batch: SequenceBatch) -> list[list[int]]:
        """Sequence indices of each micro-batch: ``micro_batch_size`` consecutive ones, or the token
        budget's groups (agents/packing.py, one rank); keeps (real, run) token counts for the padding
        fraction."""
        lengths = [int(ids.numel()) for ids in batch.input_ids]
        if self.max_tokens_per_microbatch > 0:
            plan = plan_micro_batches(lengths, 1, self.max_tokens_per_microbatch, self.geometry)
        else:
            plan = count_micro_batches(len(batch), self.micro_batch_size, 1)
        self._split_tokens = plan.tokens(lengths, self.geometry)
        return [list(idx) for idx in plan.ranks[0]]

    def token_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> LogProbOutput:
        """No-grad per-token log-probs of the response tokens (packed), micro-batched."""
        start = time.perf_counter()
        self.model.eval()
        lens = batch.response_lens
        cu = torch.zeros(len(lens) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(lens, 0)
        token_logps = torch.zeros(int(cu[-1]), dtype=torch.float32)
        sums = torch.zeros(len(batch), dtype=torch.float32)
        with torch.no_grad():
            for idx in self._micro_batches(batch):
                out = self._logprobs(batch.select(idx), temperature)
                for j, i in enumerate(idx):  # each sequence's log-probs to its place in the batch
                    token_logps[int(cu[i]) : int(cu[i + 1])] = out.token_logps[int(out.cu_seqlens[j]) : int(out.cu_seqlens[j + 1])]
                    sums[i] = out.seq_logp_sum[j]
        self._stats["logprob_tokens_per_s"] = batch.num_tokens() / max(time.perf_counter() - start, 1e-9)
        return LogProbOutput(token_logps, cu, sums, lens)

    def keep_version(self, version: int) -> None:
        """Snapshot the live weights as ``version`` (agents/reference.WeightVersions)."""
        self._versions().keep(version)

    def drop_versions(self, below: int) -> None:
        self._versions().drop_below(below)

    def sequence_logprobs_at(self, version: int, batch: SequenceBatch,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sequence_logprobs` under the weights of snapshot ``version``."""
        return self._versions().run(version, lambda: self.sequence_logprobs(batch, temperature))

    def _versions(self) -> WeightVersions:
        if getattr(self, "_weight_versions", None) is None:
            self._weight_versions = WeightVersions(self.name, lambda: self.model.parameters())
        return self._weight_versions

    def keep_reference(self) -> None:
        """Keep the current weights (host copy) as the KL penalty's frozen reference (agents/reference.py)."""
        self._reference = ReferenceWeights(self.model.parameters())

    def reference_token_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> LogProbOutput:
        """:meth:`token_logprobs` under the weights :meth:`keep_reference` kept."""
        if getattr(self, "_reference", None) is None:
            raise missing_reference(self.name)
        return self._reference.run(lambda: self.token_logprobs(batch, temperature))

    def sequence_logprobs(self, batch: SequenceBatch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.token_logprobs(batch, temperature)
        return out.seq_logp_sum, out.seq_len

    # ---- update ----------------------------------------------------------------------------
    def _set_lr(self) -> float:
        warmup, total, schedule = self._schedule
        lr = self.base_lr * lr_multiplier(self.updates, warmup, total, schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def train(self, mini_batches: list[SequenceBatch], loss_fn: LossFn, temperature: float = 1.0) -> list[dict[str, float]]:
        """One AdamW update per mini-batch m = 0..M−1; micro-batch losses are globally normalised."""
        self.model.train()
        results, real, run = [], 0, 0
        for m, mini in enumerate(mini_batches):
            start = time.perf_counter()
            lr = self._set_lr()
            self.optimizer.zero_grad(set_to_none=True)
            total_loss, records, info = 0.0, [], mini.info(m)
            for idx in self._micro_batches(mini):
                mb = mini.select(idx)
                out = self._logprobs(mb, temperature)
                loss, metrics = loss_fn(out, mb.loss_inputs, info)
                loss.backward()
                total_loss += float(loss.detach())
                records.append((metrics, len(mb)))
            params = [p for p in self.model.parameters() if p.grad is not None]
            max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
            self.optimizer.step()
            self.updates += 1
            elapsed = time.perf_counter() - start
            self._stats["train_tokens_per_s"] = mini.num_tokens() / max(elapsed, 1e-9)
            metrics = mean_over_micro_batches(records)
            metrics.update(loss=total_loss, grad_norm=grad_norm, lr=lr, update=float(self.updates))
            results.append(metrics)
            real, run = real + self._split_tokens[0], run + self._split_tokens[1]
        self._stats["pad_fraction"] = 1.0 - real / max(run, 1)  # over the updates' micro-batches
        return results

    def train_async(self, mini_batches: list[SequenceBatch], loss_fn: LossFn,
                    temperature: float = 1.0) -> CompletedResult[list[dict[str, float]]]:
        """:meth:`train`, run now (the model is in this process): an already-completed result."""
        return CompletedResult(self.train(mini_batches, loss_fn, temperature))

    # ---- state -----------------------------------------------------------------------------
    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def save(self, path: str) -> dict[str, FileDigest]:
        """Weights (``hf/model.safetensors``, ``hf/config.json``) and ``optimizer.pt`` under ``path``."""
        self.begin_save(path)
        return self.end_save()

    def begin_save(self, path: str, background: bool = False) -> None:
        """Start :meth:`save` in a writer thread; ``background``: the training goes on before
        :meth:`end_save`, so the weights and optimizer state are cloned first (the wait)."""
        weights = {k: v.detach() for k, v in _unaliased(self.model.state_dict()).items()}
        optimizer = self.optimizer.state_dict()
        if background:
            weights, optimizer = {k: v.clone() for k, v in weights.items()}, copy.deepcopy(optimizer)
        if self._pending_save is not None:  # a save the trainer abandoned: stop its writer
            self._pending_save.abandon()
        (Path(path) / "hf").mkdir(parents=True, exist_ok=True)  # here: the writer creates files only
        job = partial(_write_hf_checkpoint, Path(path), weights, {"optimizer": optimizer, "updates": self.updates},
                      self.model.config.to_json_string())
        self._pending_save = BackgroundWrite(job, self.name)

    def end_save(self) -> dict[str, FileDigest]:
        """Wait for :meth:`begin_save`'s writer; every file's size and SHA-256 (paths relative to the folder)."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            raise RuntimeError("end_save() without a save begun by begin_save()")
        return pending.result()

    def load(self, path: str, expected: dict[str, FileDigest] | None = None) -> None:
        """Restore :meth:`save`'s state; ``expected``: the manifest's digests, checked as each file is read."""
        src = Path(path)
        if not (src / "optimizer.pt").exists():
            raise FileNotFoundError(f"{src}: not an HFAgent checkpoint (no optimizer.pt)")
        from safetensors.torch import load as load_safetensors

        want = expected or {}
        state: dict[str, torch.Tensor] = {}
        for shard in sorted((src / "hf").glob("*.safetensors")):
            state.update(load_safetensors(read_verified(shard, want.get(shard.relative_to(src).as_posix()))))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"{src}: checkpoint does not match model {type(self.model).__name__}: "
                             f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
        data = read_verified(src / "optimizer.pt", want.get("optimizer.pt"))
        extra = torch.load(io.BytesIO(data), weights_only=True)  # a planted file runs no code
        self.optimizer.load_state_dict(extra["optimizer"])
        self.updates = int(extra["updates"])

    def stats(self) -> dict[str, float]:
        out = dict(self._stats)
        try:
            import resource

            out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        except ImportError:  # not on every platform
            pass
        return out

    def close(self) -> None:
        """Nothing to release: the model lives in this process."""
