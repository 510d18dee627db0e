"""Capability P̂ and capability ratio ω (docs/algorithm.md §1; paper eq. 8-9), and each learner-source
pair's running log-ratio statistic for the adaptive cross window (docs/algorithm.md §5b)."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch


def positive_rate(rewards: torch.Tensor) -> float:
    """P^(k)_τ of docs/algorithm.md §1: fraction of one agent's responses in the whole step batch with reward > 0.

    rewards: any shape, all of one agent's rewards of the current step. Empty → 0.0.
    """
    if rewards.numel() == 0:
        return 0.0
    return float((rewards > 0).float().mean())


class CapabilityTracker:
    """Windowed capability estimate of n agents and their pairwise ratios.

    P̂^(k)_t = mean of P^(k)_τ over the last ``window`` steps including the current one (eq. 8);
    ω^(k,j) = clip(max(P̂^(k), floor) / max(P̂^(j), floor), ratio_min, ratio_max), ω^(k,k) = 1 (eq. 9).
    It also keeps, per ordered (learner k, source j) pair, the last ``log_ratio_window`` per-step
    statistics of log s^(k,j) (docs/algorithm.md §5b). Both histories are part of every checkpoint
    (``state_dict``), so a resumed run continues with the same ω and the same adaptive windows.
    """

    def __init__(
        self,
        num_agents: int,
        window: int = 5,
        floor: float = 1e-8,
        ratio_min: float = 0.1,
        ratio_max: float = 10.0,
        log_ratio_window: int = 5,
    ) -> None:
        if num_agents < 1:
            raise ValueError(f"num_agents={num_agents}: need at least one agent")
        if window < 1:
            raise ValueError(f"window={window}: must be >= 1")
        if floor <= 0:
            raise ValueError(f"floor={floor}: must be > 0")
        if not 0 < ratio_min <= 1 <= ratio_max:
            raise ValueError(f"ratio_min={ratio_min}, ratio_max={ratio_max}: need 0 < ratio_min <= 1 <= ratio_max")
        self.num_agents = num_agents
        self.window = window
        self.floor = floor
        self.ratio_min = ratio_min
        self.ratio_max = ratio_max
        if log_ratio_window < 1:
            raise ValueError(f"log_ratio_window={log_ratio_window}: must be >= 1")
        self.log_ratio_window = log_ratio_window
        self._history: list[deque[float]] = [deque(maxlen=window) for _ in range(num_agents)]
        self._log_ratios: dict[tuple[int, int], deque[float]] = {}

    def update(self, positive_rates: Sequence[float] | torch.Tensor) -> None:
        """Append this step's P^(k)_τ (one value in [0, 1] per agent); call before using P̂ or ω."""
        rates = torch.as_tensor(positive_rates, dtype=torch.float64).flatten().tolist()
        if len(rates) != self.num_agents:
            raise ValueError(f"update() got {len(rates)} rates for {self.num_agents} agents")
        for k, rate in enumerate(rates):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"positive rate of agent {k} is {rate}: must lie in [0, 1]")
            self._history[k].append(rate)

    @property
    def steps_seen(self) -> int:
        return len(self._history[0])

    def capability(self) -> torch.Tensor:
        """P̂: [n] float64, the windowed mean positive rate of each agent (eq. 8)."""
        if self.steps_seen == 0:
            raise RuntimeError("CapabilityTracker.capability() before any update(): no step seen yet")
        return torch.tensor([sum(h) / len(h) for h in self._history], dtype=torch.float64)

    def omega(self) -> torch.Tensor:
        """ω: [n, n] float64 with omega[k, j] = clip(P̂_k / P̂_j) and an exact 1 diagonal (eq. 9)."""
        p = self.capability().clamp_min(self.floor)
        ratio = (p[:, None] / p[None, :]).clamp(self.ratio_min, self.ratio_max)
        ratio.fill_diagonal_(1.0)
        return ratio

    def record_log_ratio(self, learner: int, source: int, value: float) -> None:
        """Append one step's statistic of log s^(learner, source) (e.g. the step's median), learner ≠ source."""
        if learner == source or not (0 <= learner < self.num_agents and 0 <= source < self.num_agents):
            raise ValueError(f"record_log_ratio({learner}, {source}): need two different agents in "
                             f"[0, {self.num_agents})")
        if value != value or abs(value) == float("inf"):
            raise ValueError(f"record_log_ratio({learner}, {source}): value {value} is not finite")
        self._log_ratios.setdefault((learner, source), deque(maxlen=self.log_ratio_window)).append(float(value))

    def median_log_ratio(self, learner: int, source: int) -> float | None:
        """Median of the pair's last ``log_ratio_window`` recorded statistics; None before any."""
        values = self._log_ratios.get((learner, source))
        return statistics.median(values) if values else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_agents": self.num_agents,
            "window": self.window,
            "history": [list(h) for h in self._history],
            "log_ratio_window": self.log_ratio_window,
            "log_ratios": [[k, j, list(v)] for (k, j), v in sorted(self._log_ratios.items())],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_agents") != self.num_agents:
            raise ValueError(
                f"tracker checkpoint has num_agents={state.get('num_agents')}, this run has {self.num_agents}"
            )
        history = state["history"]
        self._history = [deque((float(x) for x in h), maxlen=self.window) for h in history]
        # checkpoints written before the adaptive window existed have no "log_ratios": empty history
        self._log_ratios = {(int(k), int(j)): deque((float(x) for x in v), maxlen=self.log_ratio_window)
                            for k, j, v in state.get("log_ratios", [])}
