"""Regenerate the warm-up weights the package ships for a preset (default: the CPU demo).

    python tools/ship_warmup.py [--preset cpu_demo] [--out hacrl_megatron/presets/warmup] [--check-only]

Runs the package's own supervised warm-up (``trainer.pretrain.warm_up_agent``, exactly what
``hacrl pretrain --force`` runs) for every agent of the preset in a fresh temporary cache, checks each
reached its ``warmup_sft_target``, and replaces that preset's folders under ``--out``
(``<agent>-<key hash>``: model, config, tokenizer and ``warmup.json`` with steps, accuracy and
seconds). Folders of those agents with another key (a stale warm-up) are removed. Needs ~5 minutes on
2 CPU cores. ``--check-only`` trains into the temporary cache and reports without touching ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python tools/ship_warmup.py` from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from hacrl_megatron.config import load_config  # noqa: E402
from hacrl_megatron.trainer import pretrain  # noqa: E402


def regenerate(preset: str, cache: Path) -> dict[str, tuple[Path, dict]]:
    """Train every warm-up of ``preset`` into ``cache``; agent name → (folder, warmup.json contents).

    Raises RuntimeError naming an agent whose warm-up stopped below its target (at max steps).
    """
    exp = load_config(preset)
    previous = os.environ.get("HACRL_CACHE")
    os.environ["HACRL_CACHE"] = str(cache)
    try:
        dirs = pretrain.pretrain_all(exp, force=True)
    finally:
        if previous is None:
            os.environ.pop("HACRL_CACHE", None)
        else:
            os.environ["HACRL_CACHE"] = previous
    out = {}
    for agent in exp.agents:
        if agent.name not in dirs:
            continue
        info = json.loads((dirs[agent.name] / pretrain.INFO_FILE).read_text())
        if info["greedy_accuracy"] < agent.warmup_sft_target:
            raise RuntimeError(f"{preset}: warm-up of {agent.name} stopped at accuracy {info['greedy_accuracy']:.2f} "
                               f"after {info['steps']} steps, below its target {agent.warmup_sft_target}")
        out[agent.name] = (dirs[agent.name], info)
    return out


def ship(found: dict[str, tuple[Path, dict]], out_dir: Path) -> list[Path]:
    """Copy the warm-ups into ``out_dir``, replacing every older folder of the same agents."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (folder, _) in found.items():
        for old in out_dir.glob(f"{name}-*"):
            shutil.rmtree(old)
        target = out_dir / folder.name
        shutil.copytree(folder, target)
        for file in target.iterdir():
            file.chmod(0o644)  # save_pretrained writes some files 0600; package data must be readable by all
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cpu_demo", help="preset whose warm-ups to ship (default cpu_demo)")
    parser.add_argument("--out", type=Path, default=pretrain.SHIPPED_DIR, help="folder of the shipped warm-ups")
    parser.add_argument("--check-only", action="store_true", help="regenerate and report; do not write --out")
    args = parser.parse_args(argv)
    from hacrl_megatron.console import log_to_console

    log_to_console()
    with tempfile.TemporaryDirectory(prefix="hacrl_ship_warmup_") as cache:
        found = regenerate(args.preset, Path(cache))
        for name, (folder, info) in found.items():
            print(f"{name}: {folder.name}: {info['steps']} steps, accuracy {info['greedy_accuracy']:.2f}, "
                  f"{info['seconds']:.0f} s")
        if not args.check_only:
            for path in ship(found, args.out):
                print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
