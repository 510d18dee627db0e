"""Metric sinks: JSONL (always), TensorBoard and wandb (when asked and installed), a progress bar.

Keys are namespaced per agent (``llama/hacpo/cross_clipfrac``).

``metrics.jsonl`` survives interruptions: each row is one ``write`` call, a row that fails half
way (a full disk) is cut off again at once, a torn last line left by a killed run is removed when
the file is opened again (resume), and :func:`read_metrics` skips a line that is not valid JSON,
reporting its line number. Opening it again also says how much of it is not metrics: damaged lines
are counted and named (and kept); a file holding no metrics row at all is moved aside whole, never
cut down to nothing, and a new one is started.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from hacrl_megatron.closing import close_all
from hacrl_megatron.config import ExperimentConfig
from hacrl_megatron.durable import OutOfSpaceError, free_bytes, fsync_dir, megabytes

logger = logging.getLogger(__name__)


def repair_torn_tail(path: Path) -> int:
    """Cut ``path`` back to its last complete line; returns the number of bytes removed (0: intact).

    A run killed (or out of space) in the middle of a row leaves a last line without its newline;
    appending the next row to it would merge the two into one unreadable line.
    """
    if not path.is_file():
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        keep = 0
        end = size
        while end > 0:  # scan back block by block for the last newline
            start = max(0, end - 65536)
            f.seek(start)
            cut = f.read(end - start).rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            end = start
        f.seek(0)
        line = f.read(keep).count(b"\n") + 1
        f.truncate(keep)
    logger.warning("%s: removed a torn last line (line %d, %d bytes) left by an interrupted run", path, line,
                   size - keep)
    return size - keep


def _line_list(numbers: list[int], shown: int = 5) -> str:
    head = ", ".join(str(n) for n in numbers[:shown])
    return head + (f" and {len(numbers) - shown} more" if len(numbers) > shown else "")


def check_existing_metrics(path: Path) -> None:
    """Before appending to an existing ``path`` (a resume): report lines that are not metrics rows
    (keeping them: :func:`read_metrics` skips them), move a file without a single metrics row aside to
    ``<name>.unreadable-<n>``, and cut a torn last line (:func:`repair_torn_tail`)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    rows, skipped = read_metrics_lines(path)
    with open(path, "rb") as f:
        lines = sum(1 for _ in f)
    if not rows and skipped:
        n = 1
        while path.with_name(f"{path.name}.unreadable-{n}").exists():
            n += 1
        aside = path.with_name(f"{path.name}.unreadable-{n}")
        os.replace(path, aside)
        logger.warning("%s: none of its %d lines is a metrics row (%s at line %d): not a metrics file of this run, "
                       "or damaged; moved aside to %s and a new one started", path, lines, skipped[0][1],
                       skipped[0][0], aside.name)
        return
    torn_last = skipped and skipped[-1][0] == lines and "no newline" in skipped[-1][1]
    damaged = [n for n, _ in (skipped[:-1] if torn_last else skipped)]
    if damaged:
        logger.warning("%s: %d of its %d lines are not metrics rows (line %s); they are kept, and read_metrics "
                       "skips them", path, len(damaged), lines, _line_list(damaged))
    repair_torn_tail(path)


def set_aside_replayed(path: Path, start_step: int) -> None:
    """Keep one row per step: a run resumed at ``start_step`` logs the later steps again, so the rows an
    earlier process wrote for them (after its last checkpoint; every row when it starts again from
    step 0) move to ``<name>.replayed-<n>`` (kept, not lost). Lines that are not rows stay where they are."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    keep: list[bytes] = []
    replayed: list[bytes] = []
    with open(path, "rb") as f:
        for line in f:
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError, RecursionError):
                keep.append(line)
                continue
            (replayed if step > start_step or start_step == 0 else keep).append(line)
    if not replayed:
        return
    n = 1
    while path.with_name(f"{path.name}.replayed-{n}").exists():
        n += 1
    aside, tmp = path.with_name(f"{path.name}.replayed-{n}"), path.with_name(f".{path.name}.tmp{os.getpid()}")
    for target, lines in ((aside, replayed), (tmp, keep)):
        with open(target, "wb") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)  # the aside copy is durable before the rows leave the file
    fsync_dir(path.parent)
    logger.warning("%s: %d rows of steps this resumed run logs again (after step %d) moved to %s: one row per step",
                   path, len(replayed), start_step, aside.name)


class JsonlWriter:
    """Appends one JSON object per line to ``path``; a failed write leaves no partial line behind.
    ``start_step``: where the run (re)starts; rows of later steps are set aside (:func:`set_aside_replayed`)."""

    def __init__(self, path: Path, start_step: int | None = None) -> None:
        self.path = path
        check_existing_metrics(path)
        if start_step is not None:
            set_aside_replayed(path, start_step)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, row: dict[str, Any]) -> None:
        data = (json.dumps(row) + "\n").encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            _write_all(self._fd, data)
        except OSError as err:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                logger.warning("%s: could not remove a partly written row (repaired on the next open)", self.path)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OutOfSpaceError(f"no space left on {self.path.parent}, needed ~{megabytes(len(data))} MB "
                                      f"for a row of {self.path.name} ({megabytes(free_bytes(self.path.parent))} MB "
                                      "free)") from err
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (a write may be partial)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class MetricsLogger:
    def __init__(self, exp: ExperimentConfig, out_dir: Path, total_steps: int, start_step: int = 0,
                 run_id: str = "") -> None:
        """``run_id``: the run's id (run.json); the wandb run's id, so that a resumed run continues it."""
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = exp.log
        self._jsonl = JsonlWriter(out_dir / "metrics.jsonl", start_step) if self.cfg.jsonl else None
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
            c = self.cfg
            self._wandb = wandb.init(project=c.wandb_project, entity=c.wandb_entity or None, group=c.wandb_group or None,
                                     tags=list(c.wandb_tags) or None, name=c.run_name or exp.name, id=run_id or None,
                                     resume="allow" if run_id else None, config=exp.to_dict())
        self._bar = None
        if self.cfg.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc=exp.name, dynamic_ncols=True)
        self._start = time.time()

    def log(self, step: int, metrics: dict[str, Any], summary: dict[str, float] | None = None,
            advance: bool = True) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if self._jsonl is not None and step % self.cfg.every == 0:
            self._jsonl.write({"step": step, "time": time.time() - self._start, **clean})
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._bar is not None and advance:
            self._bar.update(1)
            if summary:
                self._bar.set_postfix({k: f"{v:.3f}" for k, v in summary.items()}, refresh=False)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A few of a step's generations (trainer/samples.py rows): TensorBoard text ``samples`` and a wandb
        table ``samples`` (one row per shown completion); the whole file is under samples/ already."""
        if not rows or (self._tb is None and self._wandb is None):
            return
        from hacrl_megatron.samples_cli import markdown

        if self._tb is not None:
            self._tb.add_text("samples", markdown(rows), step)
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=["step", "prompt", "question", "reference", "agent", "completion", "reward",
                                         "length", "advantage", "cross"])
            for row in rows[:2]:
                for agent, items in row["agents"].items():
                    for c in items[:2]:
                        table.add_data(step, row["index"], row["question"], row["reference"], agent, c["text"],
                                       c["reward"], c["length"], json.dumps(c["advantage"]), json.dumps(c.get("cross", {})))
            self._wandb.log({"samples": table}, step=step)

    def write(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text)

    def close(self) -> None:
        """Close every sink (all are tried; the first error is raised after the others closed)."""
        closers = [self._bar and self._bar.close, self._jsonl and self._jsonl.close, self._tb and self._tb.close,
                   self._wandb and self._wandb.finish]
        close_all([c for c in closers if c], primary=None)


def read_metrics_lines(path: str | Path) -> tuple[list[dict[str, float]], list[tuple[int, str]]]:
    """(rows sorted by step, [(line number, why)] of skipped lines) of a metrics.jsonl file.

    The last row wins for a step logged twice (a resumed run repeats the steps after its checkpoint).
    A line that is not a JSON object with a ``step`` (a torn write) is skipped, not fatal.
    """
    rows: dict[int, dict[str, float]] = {}
    skipped: list[tuple[int, str]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError) as err:
                torn = "" if line.endswith("\n") else ", no newline"
                skipped.append((number, f"not a metrics row ({type(err).__name__}{torn}; a torn write?)"))
                continue
            rows[step] = row
    return [rows[s] for s in sorted(rows)], skipped


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Rows of a metrics.jsonl file sorted by step; skipped lines are logged with their line number."""
    rows, skipped = read_metrics_lines(path)
    for number, why in skipped:
        logger.warning("%s line %d: %s, skipped", path, number, why)
    return rows
