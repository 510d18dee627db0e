"""Seconds a training step waits for a checkpoint, synchronous against asynchronous, on a CPU Megatron agent.

    python benchmarks/bench_checkpoint.py [--steps 4] [--hidden 256] [--layers 4] [--vocab 32000] [--out FILE]

One LocalAgent (llama, TP = PP = DP = 1, in this process) trains one update per step on 16 sequences
of 64 tokens and is checkpointed after every step through the trainer's own path
(trainer/run_checkpoints.py: ``state.pt``, the agent's Megatron shards hashed as written, the
manifest, the rename). ``wait`` is what each save holds the loop: with ``checkpoint.async_save=false``
the whole save; with ``true`` copying the state for the writer thread plus finishing the previous
save (its write ran during the step in between). Saving after every step is the hardest case for
the asynchronous save: its write has one step to finish. Also printed: the step with a write in
flight (the writer thread shares the CPU with the training), and what the manifest's read-back pass
of every file, which saves no longer do, costs on this checkpoint. The first step and save warm up
and are not counted; medians over the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEQS, SEQ_LEN, PROMPT, MICRO = 16, 64, 16, 8


def _batch(vocab: int):
    from hacrl_megatron.agents.batch import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids = tuple(torch.randint(0, vocab, (SEQ_LEN,), generator=g) for _ in range(SEQS))
    return SequenceBatch(input_ids=ids, prompt_lens=torch.full((SEQS,), PROMPT))


def _loss(lp, inputs, info):
    return -(lp.seq_logp_sum / lp.seq_len).sum() / info.num_sequences, {}


def _agent(args):
    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.config import AgentConfig, ModelConfig, TrainConfig

    model = ModelConfig(arch="llama", hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=4,
                        ffn_hidden_size=4 * args.hidden, vocab_size=args.vocab)
    return LocalAgent(AgentConfig(name="bench", model=model, lr=1e-4), TrainConfig(micro_batch_size=MICRO))


def run_mode(agent, batch, root: Path, background: bool, steps: int) -> dict[str, float]:
    """``steps`` + 1 train-and-save rounds; medians of the step and of each save's wait (the first round
    warms up)."""
    from hacrl_megatron.trainer.run_checkpoints import RunCheckpoints

    runtime = types.SimpleNamespace(name="bench", trainer=agent)
    saves = RunCheckpoints(root, keep=2, background=background)
    step_s, wait_s, copy_s = [], [], []
    for i in range(steps + 1):
        started = time.perf_counter()
        agent.train([batch], _loss)
        step = time.perf_counter() - started
        in_flight = saves.pending is not None
        started = time.perf_counter()
        saves.finish()  # the previous save (async: written during the step)
        finished = time.perf_counter() - started
        saves.save(i + 1, [runtime], {"history": {}})
        wait = finished + saves.take_wait_s()
        if i:
            step_s.append(step)
            wait_s.append(wait)
            copy_s.append(wait - finished)
        assert background or not in_flight
    saves.finish()
    return {"step_s": statistics.median(step_s), "wait_s": statistics.median(wait_s),
            "copy_s": statistics.median(copy_s)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training (default 1: the writer "
                    "thread gets the other core of a 2-core machine)")
    ap.add_argument("--out", help="also write the numbers as JSON")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    from hacrl_megatron.trainer import checkpoint as ckpt

    agent, batch = _agent(args), _batch(args.vocab)
    with tempfile.TemporaryDirectory() as tmp:
        sync = run_mode(agent, batch, Path(tmp) / "sync", background=False, steps=args.steps)
        asynchronous = run_mode(agent, batch, Path(tmp) / "async", background=True, steps=args.steps)
        last = ckpt.latest_checkpoint(Path(tmp) / "sync")
        files = [p for p in last.rglob("*") if p.is_file()]
        size_mb = sum(p.stat().st_size for p in files) / 1e6
        started = time.perf_counter()
        ckpt._hash_all(last, [p.relative_to(last).as_posix() for p in files])  # what every save used to add
        read_back_s = time.perf_counter() - started
    result = {"model": f"llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}",
              "parameters": agent.num_parameters(), "checkpoint_mb": round(size_mb, 1),
              "cpu_cores": os.cpu_count(), "torch_threads": args.threads, "rounds": args.steps,
              "sync": {k: round(v, 3) for k, v in sync.items()},
              "async": {k: round(v, 3) for k, v in asynchronous.items()},
              "manifest_read_back_s": round(read_back_s, 3)}
    print(f"{result['model']}: {result['parameters'] / 1e6:.1f} M parameters, checkpoint {size_mb:.0f} MB "
          f"(model + Adam state + state.pt), {os.cpu_count()} cores, {args.threads} torch thread(s)")
    print("| checkpoint.async_save | wait per save | copy for the writer | finishing the previous save | "
          "train step | wait / step |")
    print("|---|---|---|---|---|---|")
    for name, r in (("false", sync), ("true", asynchronous)):
        copy, rest = (f"{r['copy_s']:.3f} s", f"{r['wait_s'] - r['copy_s']:.3f} s") if name == "true" else ("–", "–")
        print(f"| {name} | {r['wait_s']:.3f} s | {copy} | {rest} | {r['step_s']:.3f} s | "
              f"{r['wait_s'] / r['step_s']:.0%} |")
    print(f"the manifest's read-back of every file (no longer done): {read_back_s:.3f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
