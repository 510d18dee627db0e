"""Who holds the GPUs when: the one order in which colocated engines and trainers take turns on the
GPUs they share (``rollout.colocate``, ``rollout.colocate_offload``; docs/colocation.md).

Colocated engines give their memory back and take it again (SGLang's memory saver, vLLM's sleep mode,
rollout/engine_pool.py); the trainers move their state to host memory and back (agents/offload.py).
:class:`ColocationSchedule` holds the order; the loop calls it at the three turns of a step:

=============  ========================================================================================
turn           what happens, in order
=============  ========================================================================================
generation     the trainers sleep, the engines hold weights and KV cache: the step's rollout
training       the engines release everything; the trainers wake: verify, π_old passes, M updates
sync           1. the trainers' optimizer state, fp32 main weights and gradients go to host memory
               2. the engines take back their weights' memory; the new weights are pushed (the trainers'
                  weights are still on the GPU: the export reads them) and the trainers score the probe
               3. the trainers' weights go to host memory too (``colocate_offload: all``)
               4. the engines take back their KV cache and score the probe (the post-sync check)
=============  ========================================================================================

after which the next step's generation turn has nothing left to do. The sync sits between training
and generation because the engines need the new weights and only an awake trainer can export them;
splitting the trainer's sleep around the push keeps the peak of the sync at the trainer's weights plus
the engines' weights (no optimizer state, no KV cache), and the KV cache comes back only once nothing
of the trainer is left on the GPU. Each move is one phase over every agent before the next phase starts
(an agent's engines may sit on another agent's trainer GPUs); within a phase, agents whose trainer and
engines run elsewhere (Ray ranks, servers) move at the same time (trainer/concurrency.py).

Outside the step: an evaluation is a generation turn; a checkpoint and an HF export need the trainers'
whole state, a training turn. The engines lose their weights when they release (SGLang drops them), so
the generation turn after such a training turn pushes the same weights again: one extra sync per
checkpoint or export, its only cost. Right after setup or a resume both sides hold their memory (the
trainers were built, the engines started on the same weights): the first generation turn only puts the
trainers to sleep.

Without colocation every turn is a no-op but the sync, which pushes and checks as it always did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hacrl_megatron.config import ExperimentConfig
from hacrl_megatron.sync.check import compare_logprobs, trainer_logprob
from hacrl_megatron.trainer.concurrency import for_each, runs_in_process
from hacrl_megatron.trainer.runtime import AgentRuntime

SHARED, GENERATION, TRAINING = "shared", "generation", "training"  # who holds the GPUs now (SHARED: both)
Probe = Callable[[AgentRuntime], tuple[list[int], list[int]]]  # an agent's (prompt ids, response ids)


@dataclass
class ColocationSchedule:
    """The turns of colocated engines and trainers (module docstring).

    Args:
        runtimes: the agents trained in this process.
        colocated: ``rollout.colocate``.
        offload: ``rollout.colocate_offload`` (``none`` without colocation).
    """

    runtimes: list[AgentRuntime]
    colocated: bool = False
    offload: str = "none"
    turn: str = SHARED

    @classmethod
    def for_run(cls, exp: ExperimentConfig, runtimes: list[AgentRuntime]) -> ColocationSchedule:
        colocated = exp.rollout.colocate
        return cls(list(runtimes), colocated, exp.rollout.colocate_offload if colocated else "none")

    def _each(self, work: Callable[[AgentRuntime], Any], *parts: str) -> list[Any]:
        """``work`` for every agent; at once for those whose ``parts`` ("trainer", "engine") run elsewhere."""
        return for_each(self.runtimes, work, lambda rt: runs_in_process(*(getattr(rt, p) for p in parts)))

    def _trainers_sleep(self, level: str) -> None:
        """The trainers sleep at most as deep as ``level``, at most as deep as configured; ``none``
        still empties their CUDA cache (what their last pass freed goes back to the engines)."""
        if not self.colocated:
            return
        level = {"none": "none", "optimizer": "optimizer"}.get(self.offload, level)
        self._each(lambda rt: rt.trainer.sleep(level), "trainer")

    # ----------------------------------------------------------------------------------------
    # the turns

    def for_generation(self) -> None:
        """The engines generate next: the trainers sleep and the engines hold weights and KV cache (after
        a training turn outside a step's sync, the engines get the weights again, unchecked)."""
        if not self.colocated or self.turn == GENERATION:
            return
        if self.turn == TRAINING:
            self.sync()
            return
        self._trainers_sleep("all")  # SHARED: the engines still hold what they started with
        self.turn = GENERATION

    def for_training(self) -> None:
        """The trainers compute next (updates, π_old passes, a checkpoint, an export): the engines
        release their memory, then the trainers wake."""
        if not self.colocated or self.turn == TRAINING:
            return
        self._each(lambda rt: rt.engine.release_memory(), "engine")
        self._each(lambda rt: rt.trainer.wake(), "trainer")
        self.turn = TRAINING

    def sync(self, probe: Probe | None = None) -> dict[str, float]:
        """Push every agent's weights into its engines (module docstring, the sync turn) and, with
        ``probe``, check each: agent name → |trainer − engine| Σ log-prob of its probe (nats). Leaves
        the generation turn (colocated)."""
        self.for_training()  # a no-op inside a step: the updates just ran there
        self._trainers_sleep("optimizer")
        if self.colocated:
            self._each(lambda rt: rt.engine.resume_memory(["weights"]), "engine")

        probes = {rt.name: probe(rt) for rt in self.runtimes} if probe is not None else {}

        def push(rt: AgentRuntime) -> float | None:
            rt.sync_weights()
            return trainer_logprob(rt.trainer, *probes[rt.name]) if probes else None

        trainer_sums = self._each(push, "trainer", "engine")
        self._trainers_sleep("all")
        if self.colocated:
            self._each(lambda rt: rt.engine.resume_memory(), "engine")
            self.turn = GENERATION
        if not probes:
            return {}

        def check(item: tuple[AgentRuntime, float]) -> float:
            rt, trainer_sum = item
            prompt_ids, response_ids = probes[rt.name]
            return compare_logprobs(rt.name, trainer_sum, rt.engine.sequence_logprob(prompt_ids, response_ids),
                                    len(response_ids))

        items = list(zip(self.runtimes, trainer_sums))
        diffs = for_each(items, check, lambda item: runs_in_process(item[0].engine))
        return {rt.name: diff for rt, diff in zip(self.runtimes, diffs)}
