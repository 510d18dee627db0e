"""All engine clients of one agent as one :class:`~hacrl_megatron.rollout.types.TrainingEngine`.

The pool holds any :class:`~hacrl_megatron.rollout.protocol.EngineClient` (SGLang servers on GPU,
in-process HF engines on CPU) behind any weight transport of ``sync/`` whose operations the
clients offer (checked when the pool is built).

A 70B agent rolls out on several servers (e.g. 4 × TP8). :meth:`EnginePool.generate` spreads one
call's prompts over the live engines by *pending tokens* (largest job first to the engine with
the fewest tokens in flight; a job costs ``(prompt length + max_new_tokens) · n``), sends every
engine its share concurrently, and keeps what finished. An engine whose server died
(:class:`~hacrl_megatron.rollout.protocol.EngineUnreachable` and the server is gone) is
restarted in the background while its prompts go to the survivors, and so is one that is up but
cannot serve (it answers HTTP 5xx to a generation or a weight update, as vLLM does once its engine
core died: one warning names the agent, the engine and the server's own last error lines; a server
that keeps answering 5xx after :data:`MAX_FAULT_RESTARTS` restarts in a row stays down, named in the
error of the pool's next call that finds no engine left); the restarted server gets the
current weights back from the weight transport (disk: reloads the last folder) or, for
transports that need the trainer (tensor, distributed), from the last ``export`` given to
:meth:`EnginePool.sync_from` at the pool's next call (never concurrently with the trainer). A
server that dies during a sync is dropped from it, the others are synced, and it is restarted.
Sample seeds are fixed per (prompt, sample) before the split, so the result does not depend on
how prompts were spread.

Weights go to every engine through one transport of ``sync/`` (``transport.push``). Colocated
engines (sharing the trainer's GPUs) release their memory on :meth:`EnginePool.release_memory`
(the trainer is about to train) and take back the weights' memory first, then the KV cache's,
around the next sync. A caller that resumed the weights itself (``resume_memory(["weights"])``: the
colocation schedule, trainer/colocation.py, which puts the trainer's weights to sleep between the
push and the KV cache) resumes the KV cache itself too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hacrl_megatron.rollout.protocol import (
    EngineClient,
    EngineError,
    EngineNodeLost,
    EngineUnreachable,
    WeightTransport,
    check_reachable,
)
from hacrl_megatron.rollout.servers import server_fault, server_log_errors
from hacrl_megatron.rollout.types import Completion, SamplingParams, sample_seeds

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
READY, STALE, DEAD = "ready", "stale", "dead"  # stale: restarted, still on its initial weights
RETIRED = "retired"  # its node left the cluster: never restarted, never synced, its bundle share released
MAX_FAULT_RESTARTS = 2  # restarts in a row of a server that answers 5xx before it is left down
Export = Callable[[], Iterable[tuple[str, "torch.Tensor"]]]
MEMORY_TAGS = ("weights", "kv_cache")  # what colocated engines release and resume (SGLang's tags, vLLM's too)


@dataclass
class _Slot:
    engine: EngineClient
    state: str = READY
    pending_tokens: int = 0
    recovery: threading.Thread | None = None
    error: BaseException | None = None
    lost_jobs: int = 0  # prompts re-sent elsewhere because this engine died with them
    faults: int = 0  # 5xx answers in a row (reset by a served request): restarts for faults
    sequences: int = field(default=0)


class EnginePool:
    """Args:
        engines: one client per engine of the agent (names label the metrics).
        transport: the weight transport (``sync/``) that reaches every engine; each engine must offer
            the operations it calls (``transport.engine_protocol``), else ValueError names the engine.
        colocate: the servers share the trainer's GPUs (memory release/resume around training).
        name: the agent's name (messages).
    """

    def __init__(self, engines: Sequence[EngineClient], transport: WeightTransport, *, colocate: bool = False,
                 name: str = "agent") -> None:
        if not engines:
            raise ValueError(f"EnginePool {name!r}: no engines")
        check_reachable(engines, transport, f"EnginePool {name!r}")
        self.slots = [_Slot(e) for e in engines]
        self.transport = transport
        self.colocate = colocate
        self.name = name
        self.weight_version = 0
        self._export: Export | None = None
        self._released: set[str] = set()  # what the colocated engines gave back: "weights", "kv_cache"
        self._lock = threading.Lock()
        self._seconds = 0.0

    @property
    def engines(self) -> list[EngineClient]:
        return [s.engine for s in self.slots]

    @property
    def runs_in_process(self) -> bool:
        """Whether any client computes in this process (an in-process HF engine; a client that does not
        say counts as one): then the loop drives this agent's engines one agent after another, else in a
        thread of its own while other agents' engines work (trainer/concurrency.py)."""
        return any(getattr(s.engine, "runs_in_process", True) for s in self.slots)

    # ----------------------------------------------------------------------------------------
    # generation

    def _live(self) -> list[_Slot]:
        return [s for s in self.slots if s.state == READY]

    @staticmethod
    def _assign(todo: list[int], costs: list[int], live: list[_Slot]) -> dict[int, list[int]]:
        """Prompt indices per slot index: longest job first onto the least-loaded engine."""
        load = {i: live[i].pending_tokens for i in range(len(live))}
        plan: dict[int, list[int]] = {i: [] for i in range(len(live))}
        for p in sorted(todo, key=lambda p: (-costs[p], p)):
            k = min(load, key=lambda i: (load[i], i))
            plan[k].append(p)
            load[k] += costs[p]
        return {k: sorted(v) for k, v in plan.items() if v}

    def _run_share(self, slot: _Slot, share: list[int], prompts: list[list[int]], params: SamplingParams,
                   seeds: list[int] | None, costs: list[int], out: list[list[Completion] | None]) -> list[int]:
        """Generate ``share`` on ``slot``; returns the prompt indices to redo elsewhere ([] on success)."""
        n, cost = params.n, sum(costs[p] for p in share)
        with self._lock:
            slot.pending_tokens += cost
        try:
            sub_seeds = None if seeds is None else [seeds[p * n + j] for p in share for j in range(n)]
            groups = slot.engine.generate_seeded([prompts[p] for p in share], params, sub_seeds)
        except EngineUnreachable:
            if slot.engine.alive():
                raise  # a reset with the server still up is not a crash: report it
            self._start_recovery(slot)
            slot.lost_jobs += len(share)
            return share
        except EngineError as err:
            if server_fault(err) is None:
                raise  # a refusal (4xx: a bad request) is ours to report, not the server's fault
            self._fault(slot, err, "a generation")
            slot.lost_jobs += len(share)
            return share
        finally:
            with self._lock:
                slot.pending_tokens -= cost
        for p, group in zip(share, groups):
            out[p] = group
        slot.sequences += len(share) * n
        slot.faults = 0
        return []

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt, spread over the live engines; ``out[i][j]`` is sample j of prompt i."""
        for i, p in enumerate(prompt_token_ids):
            if len(p) == 0:
                raise ValueError(f"EnginePool.generate: prompt {i} is empty")
        if not prompt_token_ids:
            return []
        self.resume_memory()
        self._resync_stale()
        prompts = [list(p) for p in prompt_token_ids]
        seeds = None if params.greedy else sample_seeds(params.seed, len(prompts) * params.n)
        costs = [(len(p) + params.max_new_tokens) * params.n for p in prompts]
        out: list[list[Completion] | None] = [None] * len(prompts)
        todo, start = list(range(len(prompts))), time.perf_counter()
        while todo:
            live = self._live() or self._wait_for_recovery()
            plan = self._assign(todo, costs, live)
            with ThreadPoolExecutor(max_workers=len(plan), thread_name_prefix=f"{self.name}-rollout") as pool:
                futures = [pool.submit(self._run_share, live[k], share, prompts, params, seeds, costs, out)
                           for k, share in plan.items()]
                todo = sorted(p for f in futures for p in f.result())
        self._seconds += time.perf_counter() - start
        return [group for group in out if group is not None]

    def sequence_logprob(self, prompt_ids: list[int], response_ids: list[int]) -> float:
        """Σ log π(response | prompt) on the first live engine (temperature 1)."""
        self.resume_memory()
        live = self._live() or self._wait_for_recovery()
        return live[0].engine.sequence_logprob(prompt_ids, response_ids)

    # ----------------------------------------------------------------------------------------
    # failures

    def _start_recovery(self, slot: _Slot) -> None:
        with self._lock:
            if slot.state == RETIRED or (slot.state == DEAD and slot.recovery is not None
                                         and slot.recovery.is_alive()):
                return
            slot.state = DEAD
            slot.recovery = threading.Thread(target=self._recover, args=(slot,), daemon=True,
                                             name=f"{self.name}-{slot.engine.name}-restart")
            slot.recovery.start()

    def _fault(self, slot: _Slot, err: BaseException, during: str) -> None:
        """``slot``'s server answered 5xx: one warning, then a restart and a resync like a dead one
        (or, after :data:`MAX_FAULT_RESTARTS` in a row, it stays down with ``err``)."""
        status, _ = server_fault(err) or (0, "")
        slot.faults += 1
        engine = slot.engine
        logger.warning("agent %r, %s (%s): the server answered HTTP %d to %s, so it is up but cannot serve; %s. "
                       "Its reply: %s\nThe server's last error lines:\n%s", self.name, engine.name,
                       getattr(engine, "base_url", "in process"), status, during,
                       "restarting it and resyncing its weights" if slot.faults <= MAX_FAULT_RESTARTS
                       else f"leaving it down after {MAX_FAULT_RESTARTS} restarts in a row", err,
                       server_log_errors(engine))
        if slot.faults > MAX_FAULT_RESTARTS:
            with self._lock:
                slot.state, slot.error = DEAD, err
            return
        self._start_recovery(slot)

    def _recover(self, slot: _Slot) -> None:
        """Restart ``slot``'s server and let the transport restore the current weights (runs in a
        thread). Weights that need the trainer are pushed later, from the calling thread, by
        :meth:`_resync_stale`: the agent must never be driven from two threads at once."""
        try:
            slot.engine.restart()
            restored = self.weight_version == 0 or self.transport.restore(slot.engine, self.weight_version)
            slot.state, slot.error = (READY if restored else STALE), None
        except EngineNodeLost as e:
            self._retire(slot, e)
        except Exception as e:  # noqa: BLE001  (kept and reported when no engine is left)
            slot.state, slot.error = DEAD, e

    def _retire(self, slot: _Slot, err: EngineNodeLost) -> None:
        """``slot``'s node is gone: one warning, and the engine leaves the pool for good (no restart
        elsewhere, no reload at every sync); its client is closed so its placement is given back."""
        with self._lock:
            slot.state, slot.error = RETIRED, err
        left = sum(s.state != RETIRED for s in self.slots)
        logger.warning("agent %r, %s: retired from the pool, %s; %d engine(s) go on", self.name, slot.engine.name,
                       err, left)
        try:
            slot.engine.close()
        except Exception as close_err:  # noqa: BLE001 - the node is gone; what is left of it may not answer
            logger.debug("agent %r, %s: closing the retired engine: %s", self.name, slot.engine.name, close_err)

    def _resync_stale(self) -> None:
        """Push the trainer's current weights (the last ``sync_from`` export) into restarted servers."""
        for slot in self.slots:
            if slot.state == STALE and self._export is not None and self.weight_version > 0:
                self.transport.push([slot.engine], self._export(), self.weight_version)
                slot.state = READY

    def _join_recoveries(self) -> None:
        for slot in self.slots:
            if slot.recovery is not None:
                slot.recovery.join()
                slot.recovery = None

    def _wait_for_recovery(self) -> list[_Slot]:
        """No engine is live: wait for the restarts; the live engines, or EngineError."""
        self._join_recoveries()
        self._resync_stale()
        live = self._live()
        if not live:
            states = ", ".join(f"{s.engine.name}: {s.state}" + (f" ({s.error})" if s.error else "") for s in self.slots)
            raise EngineError(f"agent {self.name!r}: no engine can generate ({states}); a restarted "
                              f"server without a restorable weight source waits for the next weight sync")
        return live

    # ----------------------------------------------------------------------------------------
    # weights and memory

    def _push(self, tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]], can_retry: bool) -> int:
        """Push ``tensors()`` to every engine. A server that dies during the push is dropped, the
        push is repeated for the others (``can_retry``: ``tensors`` may be called again) and the
        dead one is restarted and resynced in the background."""
        self._join_recoveries()
        for slot in self.slots:
            if slot.state == DEAD:  # one more restart attempt before giving up on it for this sync
                self._recover(slot)
        targets = [s for s in self.slots if s.state in (READY, STALE)]
        if not targets:
            raise EngineError(f"agent {self.name!r}: every engine is down; cannot sync weights")
        resumes_kv = "weights" in self._released  # else the caller resumed the weights and owns the KV cache's turn
        if resumes_kv:  # weights first, KV cache after: the peak stays at one copy of the weights
            self._resume(["weights"], targets)
        version, dead = self.weight_version + 1, []
        try:
            count = self.transport.push([s.engine for s in targets], tensors(), version)
        except EngineError as err:
            dead = self._failed_in_push(targets, err)
            targets = [s for s in targets if s not in dead]
            if not (can_retry and dead):
                raise
            if not targets:  # every engine failed: restart them now and push to them again
                targets = self._restart_now(dead, err)
                dead = [s for s in dead if s not in targets]
            count = self.transport.push([s.engine for s in targets], tensors(), version)
        self.weight_version = version
        for s in targets:
            s.state = READY
        for s in dead:  # restarted, then restored at ``version`` (from the transport or from ``export``)
            self._start_recovery(s)
        if resumes_kv:
            self._resume(["kv_cache"], targets)
        return count

    def _failed_in_push(self, targets: list[_Slot], err: EngineError) -> list[_Slot]:
        """The engines a push failed on: down (unreachable) or up but answering 5xx (a warning each);
        [] when the error is neither (a refused request: the caller re-raises it)."""
        fault = server_fault(err)
        if fault is None:
            return [s for s in targets if not s.engine.alive()] if isinstance(err, EngineUnreachable) else []
        url = fault[1]
        faulty = [s for s in targets if url.startswith(getattr(s.engine, "base_url", "\0"))]
        for s in faulty:
            s.faults += 1
            if s.faults <= MAX_FAULT_RESTARTS:
                logger.warning("agent %r, %s (%s): the server answered HTTP %d to a weight update, so it is up but "
                               "cannot serve; restarting it and resyncing its weights. Its reply: %s\nThe server's "
                               "last error lines:\n%s", self.name, s.engine.name, s.engine.base_url, fault[0], err,
                               server_log_errors(s.engine))
        return [s for s in faulty if s.faults <= MAX_FAULT_RESTARTS]

    def _restart_now(self, slots: list[_Slot], err: EngineError) -> list[_Slot]:
        """Restart ``slots`` in this thread (no engine is left to push to); those that came back."""
        for s in slots:
            self._recover(s)
        back = [s for s in slots if s.state in (READY, STALE)]
        if not back:
            raise EngineError(f"agent {self.name!r}: every engine failed the weight update and none came back "
                              f"after a restart ({'; '.join(f'{s.engine.name}: {s.error}' for s in slots)})") from err
        return back

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Push HF-named full tensors to every engine; returns how many were sent."""
        return self._push(lambda: named_tensors, can_retry=False)

    def sync_from(self, export: Export) -> int:
        """Push ``export()`` to every engine, and keep ``export`` to restore restarted servers."""
        self._export = export
        return self._push(export, can_retry=True)

    def release_memory(self) -> None:
        """Colocated engines free their GPU memory (weights and KV cache) for the trainer."""
        if not self.colocate or self._released == set(MEMORY_TAGS):
            return
        held = [t for t in MEMORY_TAGS if t not in self._released]
        for slot in self._live():  # all at once in one request when nothing was released before
            slot.engine.release_memory(None if len(held) == len(MEMORY_TAGS) else held)
        self._released = set(MEMORY_TAGS)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back what :meth:`release_memory` freed (before generating or scoring): ``tags`` of
        :data:`MEMORY_TAGS` (None: all); what is already back is not asked for again."""
        wanted = [t for t in (MEMORY_TAGS if tags is None else tags) if t in self._released]
        if wanted:
            self._resume(wanted, self._live(), whole=len(wanted) == len(self._released) == len(MEMORY_TAGS))

    def _resume(self, tags: list[str], slots: list[_Slot], whole: bool = False) -> None:
        """``slots``' engines take back ``tags`` (``whole``: everything, in one request)."""
        for slot in slots:
            slot.engine.resume_memory(None if whole else list(tags))
        self._released -= set(tags)

    # ----------------------------------------------------------------------------------------
    # metrics and shutdown

    def stats(self) -> dict[str, Any]:
        """tokens, seconds (wall time in generate), tokens_per_s, sequences, restarts,
        weight_version; per engine ``<engine>/tokens_per_s``, ``/tokens``, ``/sequences``,
        ``/restarts``, ``/lost_jobs``, ``/live`` (1 or 0)."""
        out: dict[str, Any] = {"tokens": 0, "sequences": 0, "restarts": 0}
        for slot in self.slots:
            s = slot.engine.stats()
            out["tokens"] += s["tokens"]
            out["sequences"] += s["sequences"]
            out["restarts"] += s["restarts"]
            prefix = slot.engine.name
            out.update({f"{prefix}/tokens_per_s": s["tokens_per_s"], f"{prefix}/tokens": s["tokens"],
                        f"{prefix}/sequences": s["sequences"], f"{prefix}/restarts": s["restarts"],
                        f"{prefix}/lost_jobs": slot.lost_jobs, f"{prefix}/live": int(slot.state == READY)})
        out["seconds"] = self._seconds
        out["tokens_per_s"] = out["tokens"] / self._seconds if self._seconds > 0 else 0.0
        out["weight_version"] = self.weight_version
        return out

    def close(self) -> None:
        """Stop the transport's resources and every server this process started; idempotent."""
        self._join_recoveries()
        try:
            self.transport.close()
        finally:
            for slot in self.slots:
                slot.engine.close()
