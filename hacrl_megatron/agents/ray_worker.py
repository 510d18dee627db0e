"""One rank of a :class:`~hacrl_megatron.agents.ray_agent.RayAgent`: the code that runs inside a Ray actor.

Each :class:`RankWorker` joins the agent's ``torch.distributed`` world and builds a
:class:`~hacrl_megatron.agents.local.LocalAgent` in it. Its methods mirror the
:class:`~hacrl_megatron.agents.handle.AgentHandle` calls one by one (the controller submits them by
reference, e.g. ``RankWorker.train``, never by a method-name string), plus the start-up steps
(where am I placed, a free rendezvous port, join the world), the bucketed weight export, and the
weight push that the ranks run themselves (a :class:`WeightSender` per rank, built by the weight
transport, ``sync/distributed.py``: rank 0 broadcasts straight into the rollout servers).

This module imports neither Ray nor megatron at import time: ``ray.remote`` wraps the class on the
controller (:func:`remote_worker_class`), and megatron loads when the LocalAgent is built inside the
actor.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from hacrl_megatron import net
from hacrl_megatron.agents.batch import LogProbOutput, LossFn, SequenceBatch
from hacrl_megatron.agents.checkpoint_io import DigestMismatchError
from hacrl_megatron.agents.local import LocalAgent
from hacrl_megatron.config import AgentConfig, TrainConfig
from hacrl_megatron.models.resolved import ResolvedAgent


@dataclasses.dataclass(frozen=True)
class SharedStateDict:
    """An HF state dict as numpy arrays, which Ray's object store hands to every actor on a node
    zero-copy (one shared-memory copy per node; torch tensors would be deserialized per rank).

    arrays: name -> contiguous array (bfloat16 travels as its int16 bit pattern).
    dtypes: name -> the torch dtype name to view the array as.
    """

    arrays: dict[str, Any]
    dtypes: dict[str, str]

    @classmethod
    def from_tensors(cls, state: dict[str, torch.Tensor]) -> SharedStateDict:
        arrays, dtypes = {}, {}
        for name, t in state.items():
            t = t.detach().cpu().contiguous()
            dtypes[name] = str(t.dtype).removeprefix("torch.")
            if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bits
                t = t.view(torch.int16)
            arrays[name] = t.numpy()
        return cls(arrays, dtypes)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Read-only tensor views of the arrays (the loader only slices and copies them)."""
        out = {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            for name, arr in self.arrays.items():
                out[name] = torch.from_numpy(arr).view(getattr(torch, self.dtypes[name]))
        return out


@dataclasses.dataclass(frozen=True)
class WorkerSetup:
    """What one rank needs to build its LocalAgent besides the weights (the same for every rank but ``env``).

    env: torch.distributed environment of the rank (RANK, WORLD_SIZE, MASTER_*, LOCAL_RANK, ...).
    threads: torch intra-op threads of a rank without CUDA (its bundle's CPUs; 0: torch's default).
        A rank on a node whose GPUs Ray knows but torch cannot use (a simulated cluster's fake GPU
        resources) computes on CPU with gloo, like a rank placed without GPUs.
    resolved: the run's record of the agent (models/resolved.py), so that no rank reads its HF config
        again; None when the agent is built from parts.
    """

    env: dict[str, str]
    threads: int
    agent_cfg: AgentConfig
    train_cfg: TrainConfig
    hf_config: Any
    vocab_size: int | None
    total_updates: int | None
    resolved: ResolvedAgent | None = None


class WeightSender(Protocol):
    """One rank's side of a weight push run by the agent's ranks (built on each rank by the
    transport's factory, e.g. ``sync.distributed.RankSenderFactory``; kept between pushes).

    Every rank calls :meth:`push` with its own export stream (a collective: each tensor is a TP
    gather / PP broadcast); rank 0's sender sends, the others only advance the stream. A sender
    may name the stream it reads in an ``export`` attribute (:data:`EXPORTS`; absent: "all") and
    the part of the model it reports in ``part`` (``sync/stages.py``: "stage<k>", or None for a
    rank that takes no part), and its bytes on the wire of the last push in ``last_bytes_sent``.
    """

    def push(self, named_tensors: Iterator[tuple[str, torch.Tensor]], engines: Sequence[Any], version: int) -> int:
        """Send ``named_tensors`` to ``engines`` as weight version ``version``; the number of tensors."""

    def close(self) -> None:
        """Release what the sender holds (rank 0: the process group with the servers)."""


# what a sender's export reads: the whole model on every rank (TP gathers, PP broadcasts), its own
# pipeline stage's share only (TP gathers within the stage), or nothing (a rank that takes no part)
EXPORTS = ("all", "stage", "none")


@dataclasses.dataclass(frozen=True)
class PushOutcome:
    """One rank's part of a weight push.

    count: tensors this rank's export produced.
    error: the sender's failure (a server refused or died), raised only after this rank's export
        ran to its end in step with the other ranks: the agent's world is still usable.
    part: what the export covered: "all" (the whole model), "stage<k>" (pipeline stage k's share),
        None (this rank took no part). Ranks of one part produce the same tensors.
    bytes_held: bytes of the HF tensors this rank's export produced (what passed through it).
    bytes_sent: bytes this rank broadcast to the engines.
    """

    count: int
    error: BaseException | None = None
    part: str | None = "all"
    bytes_held: int = 0
    bytes_sent: int = 0


def push_total(outcomes: Sequence[PushOutcome]) -> int | None:
    """Tensors pushed by the ranks together: the count of each part (the whole model, or each
    pipeline stage) summed over the parts; None when ranks of one part disagree (their streams
    diverged: the world is out of step)."""
    counts: dict[str, set[int]] = {}
    for o in outcomes:
        if o.part is not None:
            counts.setdefault(o.part, set()).add(o.count)
    if any(len(c) != 1 for c in counts.values()):
        return None
    return sum(next(iter(c)) for c in counts.values())


class _WatchedStream(Iterator[tuple[str, torch.Tensor]]):
    """An export stream that counts its tensors and remembers whether the export itself raised."""

    def __init__(self, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._stream = stream
        self.count = 0
        self.bytes = 0
        self.failed = False

    def __next__(self) -> tuple[str, torch.Tensor]:
        try:
            item = next(self._stream)
        except StopIteration:
            raise
        except BaseException:
            self.failed = True
            raise
        self.count += 1
        self.bytes += item[1].numel() * item[1].element_size()
        return item


class RankWorker:
    """One rank of an agent's world. Decorated with ``ray.remote`` by :func:`remote_worker_class`."""

    def __init__(self, agent_name: str) -> None:
        self.agent_name = agent_name
        self.rank = -1  # this rank in the agent's world, once setup() ran
        self._local: LocalAgent | None = None  # once setup() ran
        self._export: Iterator[tuple[str, torch.Tensor]] | None = None
        self._sender: WeightSender | None = None

    # ---- start-up --------------------------------------------------------------------------
    def node_info(self) -> dict[str, Any]:
        """Where Ray placed this actor: node IP and id, the GPU ids Ray gave it, pid."""
        import ray

        return {"ip": ray.util.get_node_ip_address(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "pid": os.getpid(), "host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id()}

    def free_port(self) -> int:
        """A TCP port free on all interfaces of this node (the world's rendezvous port): :func:`hacrl_megatron.
        net.free_port` run on the node Ray placed this rank on (a remote call needs an actor method)."""
        return net.free_port("")

    def setup(self, cfg: WorkerSetup, hf_checkpoint: Any) -> dict[str, Any]:
        """Join the world described by ``cfg.env`` and build the LocalAgent; returns its layout info,
        ArchSpec, HF config and parameter count.

        ``hf_checkpoint``: HF directory, HF-named state dict, :class:`SharedStateDict` or None; a
        separate argument because Ray resolves object refs only at the top level of a call.
        """
        os.environ.update(cfg.env)  # before torch touches CUDA: CUDA_VISIBLE_DEVICES / LOCAL_RANK apply
        self.rank = int(cfg.env["RANK"])
        if cfg.threads > 0 and not torch.cuda.is_available():  # GPU ranks keep torch's default
            torch.set_num_threads(cfg.threads)
        if isinstance(hf_checkpoint, SharedStateDict):
            hf_checkpoint = hf_checkpoint.to_tensors()
        self._local = LocalAgent(cfg.agent_cfg, cfg.train_cfg, vocab_size=cfg.vocab_size,
                                 hf_checkpoint=hf_checkpoint, hf_config=cfg.hf_config,
                                 total_updates=cfg.total_updates, resolved=cfg.resolved)
        return {"info": dataclasses.asdict(self._local.info), "spec": self._local.spec,
                "hf_config": self._local.hf_config, "num_parameters": self._local.num_parameters()}

    # ---- the AgentHandle calls, run on every rank (SPMD) -----------------------------------
    def sequence_logprobs(self, batch: SequenceBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._local.sequence_logprobs(batch, temperature)

    def token_logprobs(self, batch: SequenceBatch, temperature: float) -> LogProbOutput:
        return self._local.token_logprobs(batch, temperature)

    def keep_reference(self) -> None:
        self._local.keep_reference()

    def keep_version(self, version: int) -> None:
        self._local.keep_version(version)

    def drop_versions(self, below: int) -> None:
        self._local.drop_versions(below)

    def sequence_logprobs_at(self, version: int, batch: SequenceBatch,
                             temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._local.sequence_logprobs_at(version, batch, temperature)

    def reference_token_logprobs(self, batch: SequenceBatch, temperature: float) -> LogProbOutput:
        return self._local.reference_token_logprobs(batch, temperature)

    def train(self, mini_batches: list[SequenceBatch], loss_fn: LossFn, temperature: float) -> list[dict[str, float]]:
        return self._local.train(mini_batches, loss_fn, temperature)

    def save(self, path: str) -> dict[str, Any]:
        return self._local.save(path)

    def sleep(self, level: str) -> None:
        self._local.sleep(level)

    def wake(self) -> None:
        self._local.wake()

    def begin_save(self, path: str, background: bool) -> None:
        self._local.begin_save(path, background)

    def end_save(self) -> dict[str, Any]:
        return self._local.end_save()

    def load(self, path: str, expected: dict[str, Any] | None = None) -> str | None:
        """None when loaded; a file that differs from the manifest comes back as its message (raised by
        RayAgent.load) instead of an error, which would tear the agent's world down: the controller
        then loads the previous checkpoint into the same workers."""
        try:
            self._local.load(path, expected)
        except DigestMismatchError as err:  # every rank finds it: torch's reader shares one rank's failure
            return str(err)
        return None

    def stats(self) -> dict[str, float]:
        return self._local.stats()

    # ---- bucketed weight export ------------------------------------------------------------
    def export_begin(self) -> None:
        """Start a fresh export stream (an abandoned one is dropped)."""
        self._export = iter(self._local.export_hf_weights())

    def export_bucket(self, max_bytes: int, keep: bool) -> tuple[list[str], list[tuple[str, torch.Tensor]]]:
        """Next tensors of the export stream up to ``max_bytes`` (at least one; none once the stream
        is done): (names, tensors if ``keep``).

        Every rank must advance the stream together (each tensor is a TP gather / PP broadcast);
        tensors are identical on all ranks, so byte counts and bucket boundaries agree.
        """
        names: list[str] = []
        kept: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in self._export:
            names.append(name)
            if keep:
                kept.append((name, tensor.detach().cpu()))
            size += tensor.numel() * tensor.element_size()
            if size >= max_bytes:
                break
        return names, kept


    # ---- weight push run by the ranks ------------------------------------------------------
    def open_weight_sender(self, make_sender: Callable[[int], WeightSender]) -> None:
        """Build this rank's sender, ``make_sender(rank)`` (the previous one is closed first)."""
        self.close_weight_sender()
        self._sender = make_sender(self.rank)

    def push_weights(self, engines: Sequence[Any], version: int) -> PushOutcome:
        """Feed a fresh export of this rank into its sender (every rank at once).

        A failure of the export itself (a broken collective) is raised: the world is then broken.
        A failure of the sender is returned, after the rest of the export ran, so that the other
        ranks' collectives complete.
        """
        if self._sender is None:
            raise RuntimeError(f"agent {self.agent_name!r}: push_weights before open_weight_sender")
        sender = self._sender
        stream = _WatchedStream(iter(self._sender_export(getattr(sender, "export", "all"))))
        error: BaseException | None = None
        try:
            sender.push(stream, engines, version)
        except Exception as e:  # noqa: BLE001  (returned to the controller, which raises it)
            if stream.failed:
                raise
            error = e
        for _ in stream:  # the export's remaining collectives, in step with the other ranks (also after a
            pass  # failure, or when a sender stopped early)
        return PushOutcome(stream.count, error, getattr(sender, "part", "all"), stream.bytes,
                           int(getattr(sender, "last_bytes_sent", 0)))

    def _sender_export(self, export: str) -> Iterator[tuple[str, torch.Tensor]]:
        if export == "stage":
            return self._local.export_stage_hf_weights()
        if export == "none":
            return iter(())
        if export != "all":
            raise ValueError(f"agent {self.agent_name!r}: a weight sender asked for export {export!r}, not one of "
                             f"{EXPORTS}")
        return self._local.export_hf_weights()

    def close_weight_sender(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()


_REMOTE_CLASS: Any = None


def remote_worker_class(ray: Any) -> Any:
    """``ray.remote(RankWorker)``, created once per process."""
    global _REMOTE_CLASS
    if _REMOTE_CLASS is None:
        _REMOTE_CLASS = ray.remote(RankWorker)
    return _REMOTE_CLASS
