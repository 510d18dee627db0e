"""Metric sinks: JSONL (always), TensorBoard and wandb (when asked and installed), a progress bar.

Keys are namespaced per agent (``llama/hacpo/cross_clipfrac``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from hacrl_megatron.config import ExperimentConfig

logger = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, exp: ExperimentConfig, out_dir: Path, total_steps: int, start_step: int = 0) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = exp.log
        self._jsonl = (out_dir / "metrics.jsonl").open("a") if self.cfg.jsonl else None
        self._tb = None
        if self.cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError as err:
                raise ImportError("log.tensorboard=true needs `pip install tensorboard` "
                                  "(or set log.tensorboard=false)") from err
        self._wandb = None
        if self.cfg.wandb:
            try:
                import wandb
            except ImportError as err:
                raise ImportError("log.wandb=true needs `pip install wandb`") from err
            self._wandb = wandb.init(project=self.cfg.wandb_project, name=exp.name, config=exp.to_dict())
        self._bar = None
        if self.cfg.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc=exp.name, dynamic_ncols=True)
        self._start = time.time()

    def log(self, step: int, metrics: dict[str, Any], summary: dict[str, float] | None = None,
            advance: bool = True) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if self._jsonl is not None and step % self.cfg.every == 0:
            self._jsonl.write(json.dumps({"step": step, "time": time.time() - self._start, **clean}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._bar is not None and advance:
            self._bar.update(1)
            if summary:
                self._bar.set_postfix({k: f"{v:.3f}" for k, v in summary.items()}, refresh=False)

    def write(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Rows of a metrics.jsonl file (the last row wins for a step logged twice after a resume)."""
    rows: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows[int(row["step"])] = row
    return [rows[s] for s in sorted(rows)]
