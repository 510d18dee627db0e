"""The frozen reference policy of the KL penalty (docs/algorithm.md §7), kept offloaded.

A :class:`ReferenceWeights` snapshot holds a host-memory copy of this rank's parameter shard at the
moment it is taken (the agent's starting weights: it is taken when the run builds the agent, before
any checkpoint is loaded, so a resumed run keeps the same reference). A reference forward swaps the
snapshot into the live parameters, runs the ordinary no-grad forward, and swaps the trained
weights back bit for bit. The reference therefore costs host memory of one copy of the rank's
shard in the parameters' dtype (2 bytes per parameter in bf16, no GPU memory beyond the forward's
own) and two device↔host copies of the shard per step, instead of a second model on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

R = TypeVar("R")


class ReferenceWeights:
    """A host copy of ``params`` (this rank's shard, in their own dtype) taken at construction."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self._params = list(params)
        self._saved = [p.detach().to("cpu", copy=True) for p in self._params]

    @property
    def num_bytes(self) -> int:
        """Host memory the snapshot holds."""
        return sum(t.numel() * t.element_size() for t in self._saved)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within the block the live parameters hold the reference; afterwards exactly what they held before."""
        live = [p.detach().to("cpu", copy=True) for p in self._params]
        try:
            with torch.no_grad():
                for p, ref in zip(self._params, self._saved):
                    p.copy_(ref.to(p.device))
            yield
        finally:
            with torch.no_grad():
                for p, value in zip(self._params, live):
                    p.copy_(value.to(p.device))

    def run(self, forward: Callable[[], R]) -> R:
        """``forward()`` with the reference weights in place."""
        with self.active():
            return forward()


class WeightVersions:
    """Snapshots of earlier weight versions of one agent (the behaviour policies of rollouts that lag
    behind training, docs/algorithm.md §7b), each a :class:`ReferenceWeights` of this rank's shard.

    ``params`` gives the live parameters (called at each snapshot, so a rebuilt module is seen).
    """

    def __init__(self, agent: str, params: Callable[[], Iterable[torch.nn.Parameter]]) -> None:
        self.agent = agent
        self._params = params
        self._kept: dict[int, ReferenceWeights] = {}

    def keep(self, version: int) -> None:
        """Snapshot the live weights as ``version`` (replacing an earlier snapshot of that version)."""
        self._kept[int(version)] = ReferenceWeights(self._params())

    def drop_below(self, version: int) -> None:
        """Free every snapshot older than ``version``."""
        for v in [v for v in self._kept if v < version]:
            del self._kept[v]

    @property
    def versions(self) -> list[int]:
        return sorted(self._kept)

    @property
    def num_bytes(self) -> int:
        return sum(w.num_bytes for w in self._kept.values())

    def run(self, version: int, forward: Callable[[], R]) -> R:
        """``forward()`` with the weights of ``version`` in place."""
        if version not in self._kept:
            raise RuntimeError(f"agent {self.agent!r}: no snapshot of weight version {version} (kept: "
                               f"{self.versions}); a rollout older than train.max_staleness cannot be corrected")
        return self._kept[version].run(forward)


def missing_reference(agent: str) -> RuntimeError:
    return RuntimeError(f"agent {agent!r}: no reference weights; call keep_reference() when the agent is built "
                        "(hacpo.kl_coef > 0 keeps the starting weights as the KL's reference)")
