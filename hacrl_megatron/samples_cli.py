"""``hacrl samples RUN [--step N]``: a training run's generations (``RUN/samples/step-*.jsonl``, written by
trainer/samples.py every ``log.samples_every`` steps), printed readably.

    hacrl samples runs/cpu_demo                 # the newest step written, every prompt and agent
    hacrl samples runs/cpu_demo --step 10 --agent llama --prompt 0
    hacrl samples runs/cpu_demo --list          # the steps that have samples

Per prompt: the question and reference, then per agent its completions with the reward, length (source
tokens), how it ended, the advantage each learner gives it (A) and each other learner's cross ratio
(s; ``clipped`` when the first update's cross window leaves it without gradient). Also used for the
TensorBoard text of the samples (:func:`markdown`). Light: no torch import.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from hacrl_megatron.errors import InputError

STEP_FILE = re.compile(r"step-(\d+)\.jsonl")


class SamplesError(InputError):
    """A run folder without samples, or a step it has none for; names the folder and what exists."""


def sample_steps(run: str | Path) -> dict[int, Path]:
    """Step → its samples file in ``run`` (a run folder, or its ``samples`` folder), in step order."""
    folder = Path(run)
    if (folder / "samples").is_dir():
        folder = folder / "samples"
    if not folder.is_dir():
        raise SamplesError(f"{run}: no such run folder")
    found = {int(m.group(1)): p for p in folder.iterdir() if (m := STEP_FILE.fullmatch(p.name))}
    return dict(sorted(found.items()))


MAX_FIELD_CHARS = 2000  # a question or reference longer than this is shown cut (the file keeps it whole)
_ROW_FIELDS = {"step": int, "index": int, "id": str, "question": str, "reference": object, "agents": dict}
_COMPLETION_FIELDS = {"text": str, "reward": (int, float), "length": int, "finish_reason": str}


def read_samples(path: Path) -> list[dict[str, Any]]:
    """The rows of one samples file. A line that is not UTF-8, not JSON (nesting too deep included) or not a
    samples row (a field missing or of another type) is named with its line number and the field."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise SamplesError(f"{path}: cannot be read ({err.strerror})") from None
    rows = []
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise SamplesError(f"{path}:{number}: not UTF-8 text (byte {err.start})") from None
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise SamplesError(f"{path}:{number}: not a samples row ({err.msg})") from None
            except RecursionError:
                raise SamplesError(f"{path}:{number}: not a samples row (nested too deeply)") from None
            rows.append(_checked_row(row, f"{path}:{number}"))
    return rows


def _checked_row(row: Any, where: str) -> dict[str, Any]:
    def expect(value: Any, kind: Any, field: str) -> None:
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise SamplesError(f"{where}: field {field!r} is a {type(value).__name__}, not a samples row's "
                               f"{getattr(kind, '__name__', 'number')}")

    expect(row, dict, "(the row)")
    for field, kind in _ROW_FIELDS.items():
        if field not in row:
            raise SamplesError(f"{where}: field {field!r} missing: not a samples row")
        expect(row[field], kind, field)
    for name, completions in row["agents"].items():
        expect(completions, list, f"agents.{name}")
        for i, c in enumerate(completions):
            expect(c, dict, f"agents.{name}[{i}]")
            for field, kind in _COMPLETION_FIELDS.items():
                if field not in c:
                    raise SamplesError(f"{where}: field 'agents.{name}[{i}].{field}' missing: not a samples row")
                expect(c[field], kind, f"agents.{name}[{i}].{field}")
    return row


def _shown(value: Any) -> str:
    """A question or reference as shown: whole up to :data:`MAX_FIELD_CHARS` characters, else cut, saying so."""
    text = str(value)
    return text if len(text) <= MAX_FIELD_CHARS else f"{text[:MAX_FIELD_CHARS]} …[{len(text) - MAX_FIELD_CHARS} more characters]"


def _number(value: float | None, signed: bool = False) -> str:
    return "–" if value is None else (f"{value:+.3f}" if signed else f"{value:.3f}")


def completion_line(i: int, c: dict[str, Any]) -> str:
    """``[i] reward 1.000  len 7 eos  A llama=+0.707 qwen3=+0.520  s qwen3=0.930 clipped``."""
    adv = " ".join(f"{k}={_number(v, signed=True)}" for k, v in c.get("advantage", {}).items())
    cross = " ".join(f"{k}={_number(x.get('ratio'))}{' clipped' if x.get('clipped') else ''}"
                     for k, x in c.get("cross", {}).items())
    return (f"[{i}] reward {_number(c['reward'])}  len {c['length']} {c['finish_reason']}"
            + (f"  A {adv}" if adv else "") + (f"  s {cross}" if cross else ""))


def format_row(row: dict[str, Any], agent: str | None = None) -> str:
    """One prompt's block as plain text: question, reference, each agent's completions (text indented)."""
    lines = [f"step {row['step']} · prompt {row['index']} · {_shown(row['id'])}", f"question : {_shown(row['question'])}",
             f"reference: {_shown(row['reference'])}"]
    for name, completions in row["agents"].items():
        if agent is not None and name != agent:
            continue
        rewards = [c["reward"] for c in completions]
        lines.append(f"  {name}: {len(completions)} completions, mean reward {sum(rewards) / max(len(rewards), 1):.3f}")
        for i, c in enumerate(completions):
            lines.append("    " + completion_line(i, c))
            text = c["text"] + (" …[cut]" if c.get("text_cut") else "")
            lines.extend("        " + part for part in (text.splitlines() or [""]))
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]], prompts: int = 2, completions: int = 2) -> str:
    """A few of ``rows`` as Markdown (TensorBoard's text panel): the first ``prompts`` prompts, the first
    ``completions`` completions of each agent, texts in code spans."""
    out = []
    for row in rows[:prompts]:
        out.append(f"**prompt {row['index']}** `{row['id']}`: {row['question']} → reference `{row['reference']}`\n")
        for name, items in row["agents"].items():
            for i, c in enumerate(items[:completions]):
                text = c["text"].replace("`", "'").replace("\n", " ⏎ ")
                out.append(f"- {name} {completion_line(i, c)}: `{text}`")
        out.append("")
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="a run's output folder (output_dir)")
    p.add_argument("--step", type=int, default=None, help="the step to show (default: the newest with samples)")
    p.add_argument("--agent", default=None, help="show this agent's completions only")
    p.add_argument("--prompt", type=int, default=None, help="show this prompt (its index in the file) only")
    p.add_argument("--list", action="store_true", help="list the steps that have samples")


def main(args: argparse.Namespace) -> int:
    steps = sample_steps(args.run)
    if not steps:
        raise SamplesError(f"{args.run}: no samples/step-*.jsonl (written every log.samples_every steps; 0 turns "
                           "them off)")
    if args.list:
        print(" ".join(str(s) for s in steps))
        return 0
    step = max(steps) if args.step is None else args.step
    if step not in steps:
        raise SamplesError(f"--step {step}: {args.run} has samples of steps {', '.join(map(str, steps))}")
    rows = read_samples(steps[step])
    if args.prompt is not None:
        rows = [r for r in rows if r["index"] == args.prompt]
        if not rows:
            raise SamplesError(f"--prompt {args.prompt}: step {step} has prompts 0..{len(read_samples(steps[step])) - 1}")
    if args.agent is not None and rows and args.agent not in rows[0]["agents"]:
        raise SamplesError(f"--agent {args.agent}: the run's agents are {', '.join(rows[0]['agents'])}")
    try:
        print("\n\n".join(format_row(r, args.agent) for r in rows), flush=True)
    except BrokenPipeError:  # `hacrl samples RUN | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit would raise again
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="hacrl samples")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
