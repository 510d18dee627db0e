"""``hacrl convert``: HF directory / GGUF ↔ Megatron distributed checkpoint, at any TP/PP.

Examples::

    hacrl convert --from-hf smollm2 --to-megatron ckpt/smollm2_tp2 --tp 2      # spawns 2 gloo ranks on CPU
    hacrl convert --from-hf ./pkg --gguf-file model.gguf --to-hf ./hf_model     # GGUF -> plain HF folder
    hacrl convert --from-megatron ckpt/smollm2_tp2 --to-hf ./smollm2_hf         # back, loadable by transformers
    hacrl convert --from-hf ./qwen3_moe --to-megatron ckpt/moe_ep2 --ep 2      # MoE: experts over 2 ranks

The model is built at ``--tp``/``--pp`` (spawning that many local processes unless the command runs
under torchrun already), loaded tensor by tensor, and written out: as a model-only Megatron
checkpoint (usable as an agent's ``init_checkpoint``) or as ``config.json`` + safetensors shards.
Megatron checkpoints written by an agent's ``save`` also convert (their optimizer state is skipped).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from hacrl_megatron.agents import checkpoint as ckpt
from hacrl_megatron.models import convert, export
from hacrl_megatron.models.convert import CheckpointMismatchError
from hacrl_megatron.models.hf_io import open_hf_model, resolve_hf_dir
from hacrl_megatron.models.parallel import (
    init_parallel,
    local_world_env,
    shutdown_parallel,
    spawn_local_world,
)
from hacrl_megatron.models.provider import (
    ArchSpec,
    ParallelLayoutError,
    UnsupportedModelError,
    arch_from_hf,
    build_gpt_model,
    validate_layout,
)
from hacrl_megatron.outputs import OutputPathError, check_dir, claim_output
from hacrl_megatron.paths import CACHE_ENV, default_cache_dir

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "chat_template.jinja", "generation_config.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``hacrl convert`` (the CLI's hook)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="HF model directory (safetensors), or 'smollm2'")
    src.add_argument("--from-megatron", metavar="DIR", help="Megatron checkpoint written by this command or an agent")
    p.add_argument("--gguf-file", help="GGUF file inside --from-hf (dequantised to --dtype)")
    dst = p.add_mutually_exclusive_group(required=True)
    dst.add_argument("--to-megatron", metavar="DIR", help="write a model-only Megatron dist checkpoint")
    dst.add_argument("--to-hf", metavar="DIR", help="write config.json + safetensors (save_pretrained layout)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the conversion world")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the conversion world")
    p.add_argument("--ep", type=int, default=1, help="MoE: expert-parallel size (the world adds data-parallel "
                   "ranks when ep·etp exceeds tp)")
    p.add_argument("--etp", type=int, default=None, help="MoE: expert tensor-parallel size (default: tp when "
                   "--ep is 1, else 1)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="parameter dtype (default: the source's)")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size for --to-hf")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``convert`` on an ``argparse`` sub-parser collection."""
    p = subparsers.add_parser("convert", help="convert HF/GGUF checkpoints to Megatron and back", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Run the conversion; returns a process exit code (0 on success)."""
    if args.tp < 1 or args.pp < 1:
        print(f"hacrl convert: --tp={args.tp} and --pp={args.pp} must be >= 1", file=sys.stderr)
        return 2
    if not (math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0):  # NaN failed inside the world
        print(f"hacrl convert: --max-shard-gb={args.max_shard_gb:g}: must be a finite number > 0", file=sys.stderr)
        return 2
    if args.gguf_file and not args.from_hf:
        print("hacrl convert: --gguf-file needs --from-hf DIR (the folder that holds the GGUF)", file=sys.stderr)
        return 2
    try:  # the destination can be written, is no run's own folder; the cache too when SmolLM2 is converted
        if args.to_megatron:
            claim_output(args.to_megatron, "--to-megatron")
        else:
            claim_output(args.to_hf, "--to-hf")
        if args.from_hf == "smollm2":
            check_dir(default_cache_dir(), f"the cache (${CACHE_ENV})")
    except OutputPathError as err:
        print(f"hacrl convert: {err}", file=sys.stderr)
        return 2
    if args.ep < 1 or (args.etp is not None and args.etp < 1):
        print(f"hacrl convert: --ep={args.ep} and --etp={args.etp} must be >= 1", file=sys.stderr)
        return 2
    _, _, dp = _expert_layout(vars(args))
    world = args.tp * args.pp * dp
    t0 = time.perf_counter()
    if not args.gguf_file:  # fail before spawning: layout and source problems named up front
        try:
            spec = _source(vars(args))[0]
            moe_args = spec.is_moe or args.ep != 1 or args.etp is not None  # dense: refused only when asked for
            ep, etp, _ = _expert_layout(vars(args)) if moe_args else (1, 1, 1)
            validate_layout(spec, args.tp, args.pp, ep, etp)
        except (ParallelLayoutError, UnsupportedModelError, CheckpointMismatchError, FileNotFoundError) as err:
            print(f"hacrl convert: {err}", file=sys.stderr)
            return 2
    if world > 1 and "WORLD_SIZE" not in os.environ:  # the rendezvous folder is removed also when a rank fails
        spawn_local_world(_spawned, world, (vars(args),), prefix="hacrl_convert_")
    else:
        convert_in_world(vars(args))
        if world > 1:  # launched by torchrun: close the world before this process exits
            shutdown_parallel()
    out = args.to_megatron or args.to_hf
    print(f"hacrl convert: wrote {out} in {time.perf_counter() - t0:.1f} s (tp={args.tp}, pp={args.pp})")
    return 0


def _expert_layout(opts: dict) -> tuple[int, int, int]:
    """(ep, etp, dp) of the conversion world: dp is the smallest data-parallel size whose tp·dp ranks
    hold ep·etp expert shards (1 for dense models)."""
    from hacrl_megatron.models.meta import default_dp

    ep = int(opts.get("ep") or 1)
    etp = opts.get("etp")
    etp = int(etp) if etp is not None else (opts["tp"] if ep == 1 else 1)
    return ep, etp, default_dp(opts["tp"], ep, etp)


def _spawned(rank: int, world: int, init_file: str, opts: dict) -> None:
    os.environ.update(local_world_env(rank, world, init_file))
    torch.set_num_threads(1)
    convert_in_world(opts)
    shutdown_parallel()  # on success only: after an error the other ranks are killed by mp.spawn


def _source(opts: dict) -> tuple[ArchSpec, Any, Any, str | None]:
    """(ArchSpec, HF config, HF tensor source or None, Megatron checkpoint or None)."""
    if opts["from_hf"]:
        hf_config, source = open_hf_model(opts["from_hf"], opts.get("gguf_file"))
        try:
            return arch_from_hf(hf_config, dtype=opts.get("dtype")), hf_config, source, None
        except UnsupportedModelError as err:  # name the file whose field it is
            raise UnsupportedModelError(f"{os.path.join(resolve_hf_dir(opts['from_hf']), 'config.json')}: {err}") from None
    spec, hf_config = ckpt.read_meta(opts["from_megatron"])
    if hf_config is None:
        raise ValueError(f"{opts['from_megatron']}: checkpoint has no HF config stored; cannot convert it")
    if opts.get("dtype"):
        spec = dataclasses.replace(spec, dtype=opts["dtype"])
    return spec, hf_config, None, opts["from_megatron"]


def convert_in_world(opts: dict) -> None:
    """Every rank: build the model at (tp, pp), load the source, write the destination."""
    spec, hf_config, source, megatron_dir = _source(opts)
    ep, etp, dp = _expert_layout(opts) if spec.is_moe else (1, 1, 1)
    init_parallel(opts["tp"], opts["pp"], dp, ep=ep, etp=etp)
    model = build_gpt_model(spec, opts["tp"], opts["pp"], ep=ep, etp=etp, init_weights=False,  # all loaded next
                            sequence_parallel=spec.is_moe and opts["tp"] > 1)
    if source is not None:
        convert.load_hf_weights(model, spec, source)
    else:
        ckpt.load_checkpoint(megatron_dir, model, None, None, spec, with_optimizer=False)
    hf_config.dtype = spec.dtype
    if opts.get("to_megatron"):
        ckpt.save_checkpoint(opts["to_megatron"], model, None, None, spec, 0, hf_config=hf_config)
        if dist.get_rank() == 0:
            _copy_tokenizer(opts, os.path.join(opts["to_megatron"], "tokenizer"))
        return
    stream = export.export_hf_weights(model, spec)
    if dist.get_rank() == 0:
        convert.save_hf_checkpoint(stream, hf_config, opts["to_hf"], int(opts.get("max_shard_gb", 2.0) * 2**30))
        _copy_tokenizer(opts, opts["to_hf"])
    else:
        for _ in stream:  # the export is collective: every rank walks the stream
            pass
    dist.barrier()


def _copy_tokenizer(opts: dict, dst: str) -> None:
    """Carry the tokenizer along (engines need it next to the weights; Megatron checkpoints keep it
    in ``<ckpt>/tokenizer`` so that the way back restores it)."""
    if opts.get("from_hf") and opts.get("gguf_file"):
        from transformers import AutoTokenizer

        folder = resolve_hf_dir(opts["from_hf"])
        AutoTokenizer.from_pretrained(folder, gguf_file=opts["gguf_file"]).save_pretrained(dst)
        return
    folder = resolve_hf_dir(opts["from_hf"]) if opts.get("from_hf") else os.path.join(opts["from_megatron"], "tokenizer")
    names = [n for n in _TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    if names:
        os.makedirs(dst, exist_ok=True)
    for name in names:
        shutil.copy2(os.path.join(folder, name), os.path.join(dst, name))
