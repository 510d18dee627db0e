"""``hacrl prepare``: fetch the paper's datasets and models before training (nothing downloads at run time).

    hacrl prepare data math math500 gsm8k aime2025 amc23 minerva olympiadbench [--out data]
    hacrl prepare data all --mirror /shared/hub_copy           # a local copy in the hub's layout
    hacrl prepare model Qwen/Qwen3-4B [--out models] [--convert --tp 2 --pp 1]

Data lands in ``<out>/<name>/<split>.jsonl`` (the presets read ``data/math/train.jsonl``; evaluation
finds the others with ``HACRL_DATA_DIR=<out>``), models in ``<out>/<repo name>`` (the presets read
``models/Qwen3-4B``). Exit status: 0 done, 2 when the hub (or mirror) cannot be read, one line each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hacrl_megatron.errors import InputError
from hacrl_megatron.outputs import claim_output
from hacrl_megatron.prepare.data import DATASETS, prepare_dataset
from hacrl_megatron.prepare.hub import HubError
from hacrl_megatron.prepare.model import convert_to_megatron, prepare_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register ``hacrl prepare data`` and ``hacrl prepare model``."""
    sub = p.add_subparsers(dest="what", metavar="{data,model}", required=True)
    d = sub.add_parser("data", help="datasets into <out>/<name>/<split>.jsonl")
    d.add_argument("names", nargs="+", metavar="NAME", help=f"{' '.join(DATASETS)}, or all")
    d.add_argument("--out", default="data", help="output folder (default data)")
    d.add_argument("--mirror", default=None, metavar="DIR", help="read DIR/<repo id> (hub layout) instead of the hub")
    m = sub.add_parser("model", help="an HF model snapshot into <out>/<name>, optionally converted to Megatron")
    m.add_argument("repo_id", metavar="HUB_ID", help="OWNER/NAME on the hub, e.g. Qwen/Qwen3-4B")
    m.add_argument("--out", default="models", help="output folder (default models)")
    m.add_argument("--name", default=None, help="folder name (default: the repository's name)")
    m.add_argument("--revision", default=None, help="branch, tag or commit")
    m.add_argument("--mirror", default=None, metavar="DIR", help="copy from DIR/<repo id> instead of the hub")
    m.add_argument("--convert", action="store_true", help="also write a Megatron checkpoint (hacrl convert)")
    m.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the Megatron checkpoint")
    m.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the Megatron checkpoint")
    m.add_argument("--convert-out", default=None, metavar="DIR",
                   help="Megatron checkpoint folder (default <out>/<name>-megatron-tp<TP>-pp<PP>)")


def _data(args: argparse.Namespace) -> int:
    names = list(DATASETS) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in DATASETS]
    if unknown:
        print(f"hacrl prepare: unknown dataset(s) {unknown}; known: {', '.join(DATASETS)} (or all)", file=sys.stderr)
        return 2
    claim_output(args.out, "--out")  # before the hub is asked for anything
    for name in names:
        counts = prepare_dataset(name, args.out, mirror=args.mirror)
        splits = ", ".join(f"{split} {n}" for split, n in counts.items())
        print(f"hacrl prepare: {name}: {splits} records in {Path(args.out) / name}")
    return 0


def _model(args: argparse.Namespace) -> int:
    if args.tp < 1 or args.pp < 1:
        print(f"hacrl prepare: --tp={args.tp} and --pp={args.pp} must be >= 1", file=sys.stderr)
        return 2
    claim_output(args.out, "--out")
    if args.convert_out:
        claim_output(args.convert_out, "--convert-out")
    folder = prepare_model(args.repo_id, args.out, name=args.name, revision=args.revision, mirror=args.mirror)
    print(f"hacrl prepare: {args.repo_id} in {folder}")
    if not args.convert:
        return 0
    target = Path(args.convert_out or f"{folder}-megatron-tp{args.tp}-pp{args.pp}")
    return convert_to_megatron(folder, target, args.tp, args.pp)


def main(args: argparse.Namespace) -> int:
    from hacrl_megatron.console import log_to_console

    log_to_console()  # to whatever sys.stderr is at each message (a root handler would keep the first one)
    try:
        return _data(args) if args.what == "data" else _model(args)
    except (HubError, InputError) as err:  # one line, no traceback: the network, a mirror, a missing repo, a path
        print(f"hacrl prepare: {err}", file=sys.stderr)
        return 2
