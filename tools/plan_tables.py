"""The planner tables of docs/scaling.md and docs/planner.md, rendered from ``hacrl plan`` itself.

    python tools/plan_tables.py --check    # exit 1 naming every table whose text differs from the planner's
    python tools/plan_tables.py --write    # rewrite the tables between their markers

Each table sits between ``<!-- plan-table: NAME -->`` and ``<!-- /plan-table -->`` in its file; every
row is one :class:`Row` (a preset, a cluster, overrides) planned as ``hacrl plan --preset ... --json``
would, and rendered by :func:`render`. A row whose plan is refused prints the planner's one-line
reason. ``tests/unit/test_plan_tables.py`` checks the files against the planner.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
H100_GIB = 74.5  # an "80 GB" H100 in GiB
H200_GIB = 131.3


@dataclass(frozen=True)
class Row:
    preset: str
    nodes: int
    gpu: str = "h100"
    gpu_memory_gib: float = H100_GIB
    overrides: tuple[str, ...] = ()
    label: str = ""  # the first cell's preset text (default: the preset's name in backticks)

    @property
    def cluster(self) -> str:
        return f"{self.nodes}×8 {self.gpu.upper()}"

    @property
    def command(self) -> str:
        extra = "".join(f" {o}" for o in self.overrides)
        return (f"hacrl plan --preset {self.preset}{extra} --nodes {self.nodes} --gpus-per-node 8 "
                f"--gpu {self.gpu} --gpu-memory-gib {self.gpu_memory_gib:g}")


PAIR_405B = "examples/multi_node_70b/llama405b_with_llama8b.yaml"
SCALING = (Row("paper_qwen3_4b_with_instruct", 1), Row("multinode_llama70b_qwen72b", 9),
           Row("multinode_llama70b_qwen72b", 9, overrides=("hacpo.cross_clip_mode=decoupled",),
               label="same, `hacpo.cross_clip_mode=decoupled`"),
           Row("multinode_llama70b_qwen72b", 16), Row("gpu_qwen3_30b_a3b_llama8b", 3),
           Row(PAIR_405B, 16, label="Llama-3.1-405B + 8B"),
           Row(PAIR_405B, 16, gpu="h200", gpu_memory_gib=H200_GIB, label="Llama-3.1-405B + 8B"))
PRESETS = (Row("paper_qwen3_4b_with_instruct", 1), Row("paper_qwen3_1p7b_with_4b_base", 1),
           Row("paper_qwen3_4b_base_with_llama3p2_3b", 1), Row("multinode_llama70b_qwen72b", 9),
           Row("multinode_llama70b_qwen72b", 16))
TABLES = {"scaling": ("docs/scaling.md", SCALING), "presets": ("docs/planner.md", PRESETS)}


@functools.cache
def plan(row: Row) -> dict[str, Any] | str:
    """``hacrl plan --json``'s object for ``row``, or the planner's one-line refusal."""
    from hacrl_megatron.plan.cli import _experiment
    from hacrl_megatron.plan.search import PlanError

    args = Namespace(preset=row.preset, overrides=list(row.overrides), nodes=row.nodes, gpus_per_node=8,
                     gpu_memory_gib=row.gpu_memory_gib, gpu=row.gpu, logprob_impl="auto")
    try:
        return _experiment(args)
    except PlanError as err:
        return str(err).splitlines()[0]


def _s(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f} s"


def _nodes(spans: list[dict[str, Any]]) -> str:
    nodes = sorted({s["node"] for s in spans})
    if len(nodes) > 2 and nodes == list(range(nodes[0], nodes[-1] + 1)):
        return f"nodes {nodes[0]}-{nodes[-1]}"
    return ("node " if len(nodes) == 1 else "nodes ") + ", ".join(map(str, nodes))


def _layout(a: dict[str, Any]) -> str:
    lay = a["layout"]
    cp = f"·CP{lay['cp']}" if lay.get("cp", 1) > 1 else ""
    text = f"TP{lay['tp']}·PP{lay['pp']}{cp}·DP{lay['dp']}{'·SP' if lay['sequence_parallel'] else ''}"
    if lay["ep"] * lay["etp"] > 1:
        text += f" EP{lay['ep']}·ETP{lay['etp']}"
    return f"{text} {lay['recompute']}"


def _engines(a: dict[str, Any], place: dict[str, Any] | None) -> str:
    r = a.get("rollout")
    if r is None:
        return "in-process engine"
    text = f"{r['engines']} × TP{r['engine_tp']} at {r['mem_fraction']:g}"
    if r["colocation"] != "separate":
        return text + " colocated"
    return f"{text} on {_nodes(place['engines'])}" if place and place["engines"] else text


def _stages(obj: dict[str, Any]) -> str:
    st = obj["step_stages_s"]
    names = (("rollout_s", "rollout"), ("verify_s", "verify"), ("retokenize_s", "re-tokenise"),
             ("old_logprob_s", "π_old"), ("train_s", "train"), ("sync_s", "sync"))
    return " + ".join(f"{label} {st[k]:,.0f}" for k, label in names)


def _overlapped(obj: dict[str, Any]) -> str:
    off = obj["step_time_one_step_off_s"]
    if off is None:
        return "–"
    alt = obj.get("overlap_plan")
    if alt and alt.get("layouts"):
        parts = "; ".join(f"{x['name']} TP{x['tp']}·PP{x['pp']}·DP{x['dp']} + {x['engine_gpus']} engine GPUs"
                          for x in alt["layouts"])
        return f"{_s(off)} (separate engines: {parts})"
    return _s(off)


def _first_cell(row: Row) -> str:
    return f"{row.label or f'`{row.preset}`'}, {row.cluster}"


def scaling_row(row: Row) -> str:
    """One docs/scaling.md row: layouts and engines per agent, peak GiB, the step, the previous loop,
    the overlapped step, and what a run adds (checkpoints: what each holds the loop, and its write;
    the export)."""
    obj = plan(row)
    if isinstance(obj, str):
        return f"| {_first_cell(row)} | refused: {obj} | – | – | – | – | – |"
    places = {p["name"]: p for p in obj["placement"]["agents"]}
    agents = "; ".join(f"{a['name']} {_layout(a)} on {_nodes(places[a['name']]['trainer'])}, "
                       f"{_engines(a, places[a['name']])}" for a in obj["agents"])
    peak = " / ".join(f"{a['memory_gib']['total']:.1f}" for a in obj["agents"])
    step = f"{_s(obj['step_time_s'])} ({_stages(obj)})"
    mode = "async" if obj["checkpoint_async"] else "sync"
    run = (f"{obj['checkpoints']} checkpoints, each {obj['checkpoint_wait_s']:,.1f} s of waiting ({mode}; "
           f"{_s(obj['checkpoint_s'])} write), export {_s(obj['export_s'])}; run {obj['run_time_s'] / 3600:,.1f} h")
    return (f"| {_first_cell(row)} | {agents} | {peak} | {step} | {_s(obj['step_time_sequential_s'])} | "
            f"{_overlapped(obj)} | {run} |")


def preset_rows(row: Row) -> list[str]:
    """docs/planner.md rows of one preset: per agent its GPUs, layout, memory terms and engines; the
    step estimate on the first agent's row."""
    obj = plan(row)
    if isinstance(obj, str):
        return [f"| `{row.preset}`, {row.nodes} × 8 | refused: {obj} |" + " |" * 13]
    places = {p["name"]: p for p in obj["placement"]["agents"]}
    out = []
    for i, a in enumerate(obj["agents"]):
        lay, m, g = a["layout"], a["memory_gib"], a["gpus"]
        colocated = a.get("rollout", {}).get("colocation", "separate") != "separate"
        gpus = f"{g['trainer']} (colocated)" if colocated else f"{g['trainer']} + {g['engines']}"
        step = ""
        if i == 0:
            step = (f"{_s(obj['step_time_s'])} ({_stages(obj)}); previous loop {_s(obj['step_time_sequential_s'])}; "
                    f"overlapped {_s(obj['step_time_one_step_off_s'])}; GSPO×2 rollout "
                    f"{_s(obj['step_gspo_x2_s']['rollout_s'])}")
        first = f"`{row.preset}`, {row.nodes} × 8" if i == 0 else ""
        out.append(f"| {first} | {a['name']} | {gpus} | {lay['tp']}·{lay['pp']}·{lay['dp']} | "
                   f"{'y' if lay['sequence_parallel'] else 'n'} | {lay['recompute']} | {m['weights']:.1f} | "
                   f"{m['grads']:.1f} | {m['optimizer']:.1f} | {m['activations']:.1f} | {m['engine']:.1f} | "
                   f"{m['total']:.1f} | {_engines(a, places[a['name']])} | "
                   f"{a['logits_gib']['saved_by_fused_kernel']:.1f} | {step} |")
    return out


HEADERS = {
    "scaling": ["| preset, cluster | per agent: trainer layout and nodes, engines | peak GiB | step (all agents per "
                "stage) | previous loop (agents in turn) | rollout overlapped | checkpoints, export, whole run |",
                "|---|---|---|---|---|---|---|"],
    "presets": ["| preset, cluster | agent | GPUs (trainer + engines) | TP·PP·DP | SP | recompute | weights | grads | "
                "opt | act | eng | total | engines | fused kernel saves | step estimate |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"],
}


def render(name: str, rows: tuple[Row, ...] | None = None) -> list[str]:
    """The table ``name``'s lines (header included) for ``rows`` (default: all of its rows)."""
    rows = TABLES[name][1] if rows is None else rows
    body = [scaling_row(r) for r in rows] if name == "scaling" else [x for r in rows for x in preset_rows(r)]
    return HEADERS[name] + body


def marked(text: str, name: str) -> list[str]:
    """The lines between table ``name``'s markers in ``text``."""
    m = re.search(rf"<!-- plan-table: {name} -->\n(.*?)<!-- /plan-table -->", text, re.S)
    if m is None:
        raise ValueError(f"no '<!-- plan-table: {name} -->' ... '<!-- /plan-table -->' block")
    return m.group(1).rstrip("\n").split("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    stale = []
    for name, (path, _) in TABLES.items():
        file = ROOT / path
        text = file.read_text()
        want = render(name)
        if marked(text, name) == want:
            continue
        stale.append(f"{path}: table {name!r} differs from hacrl plan's output")
        if args.write:
            body = "\n".join(want) + "\n"
            text = re.sub(rf"(<!-- plan-table: {name} -->\n).*?(<!-- /plan-table -->)",
                          lambda m, body=body: m.group(1) + body + m.group(2), text, flags=re.S)
            file.write_text(text)
    for line in stale:
        print(("rewrote " if args.write else "") + line, file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
