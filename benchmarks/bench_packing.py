"""Padded vs token-budget vs packed micro-batches on a length-skewed RL batch (CPU Megatron agent).

    python benchmarks/bench_packing.py                    # the default batch, printed as a table
    python benchmarks/bench_packing.py --json out.json    # also the numbers as JSON

One mini-batch of 64 sequences: prompts of 32 tokens, response lengths drawn lognormal (median 48,
sigma 0.8) and cut at 8x the median, the long tail RL rollouts have. Each cut of the same batch runs in
its own process (peak RSS per cut), one torch thread, a llama-shaped agent (hidden 256, 4 layers,
vocab 4096) through ``LocalAgent.train``, the trainer's real code path; the first update is a warm-up,
then UPDATES updates are timed:

* padded:  ``train.micro_batch_size`` = 8 sequences, each micro-batch padded to its longest;
* budget:  ``train.max_tokens_per_microbatch`` = BUDGET, micro-batches of similar lengths (padded rows);
* packed:  the same budget with ``train.pack_sequences``, several sequences per row.

Reported: real (unpadded) tokens per second of the update, the padding fraction the trainer logs
(``<agent>/trainer/pad_fraction``), the number of micro-batches, the largest micro-batch in tokens run
(what bounds activation memory) and the process's peak RSS. On a CPU the packed row's attention runs
over an explicit [T, T] block-diagonal mask (megatron's local layer spec), so attention costs grow
with the row length squared; on a GPU, Transformer Engine's THD kernels attend within each sequence
only (cu_seqlens) and skip the masked blocks. That is why the default budget is small (512 tokens,
a little more than the longest sequence): on a CPU, a row of 2048 packed tokens ran slower than padding
(0.6x), one of 512 faster (1.3-1.9x, on a machine shared with other jobs). ``--budget`` changes it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEQS, PROMPT, MEDIAN, SIGMA, MAX_FACTOR = 64, 32, 48, 0.8, 8
BUDGET, MICRO, UPDATES = 512, 8, 3
MODEL = dict(arch="llama", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, ffn_hidden_size=1024,
             vocab_size=4096)
CUTS = {
    "padded": dict(micro_batch_size=MICRO),
    "budget": dict(micro_batch_size=MICRO, max_tokens_per_microbatch=BUDGET),
    "packed": dict(micro_batch_size=MICRO, max_tokens_per_microbatch=BUDGET, pack_sequences=True),
}


def response_lengths(seed: int = 0) -> list[int]:
    """Long-tailed response lengths: lognormal around MEDIAN, at least 1, at most MAX_FACTOR x MEDIAN."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.randn(SEQS, generator=g) * SIGMA) * MEDIAN
    return [int(min(max(1, round(float(x))), MAX_FACTOR * MEDIAN)) for x in draws]


def skewed_batch():
    from hacrl_megatron.agents.batch import SequenceBatch

    g = torch.Generator().manual_seed(1)
    ids = tuple(torch.randint(0, MODEL["vocab_size"], (PROMPT + n,), generator=g) for n in response_lengths())
    return SequenceBatch(input_ids=ids, prompt_lens=torch.full((SEQS,), PROMPT))


def _loss(lp, inputs, info):
    return -(lp.seq_logp_sum / lp.seq_len).sum() / info.num_sequences, {}


def _run_cut(name: str, budget: int, queue) -> None:
    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.config import AgentConfig, ModelConfig, TrainConfig

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cut = {**CUTS[name], **({"max_tokens_per_microbatch": budget} if name != "padded" else {})}
    agent = LocalAgent(AgentConfig(name="bench", model=ModelConfig(**MODEL), lr=1e-5), TrainConfig(**cut))
    batch = skewed_batch()
    agent.train([batch], _loss)  # warm-up
    t0 = time.perf_counter()
    agent.train([batch] * UPDATES, _loss)
    seconds = (time.perf_counter() - t0) / UPDATES
    lengths = [int(ids.numel()) for ids in batch.input_ids]
    plan = agent._plan(batch)
    largest = max(agent.geometry.tokens([lengths[i] for i in mb]) for rank in plan.ranks for mb in rank)
    queue.put({"cut": name, "update_s": seconds, "real_tokens_per_s": sum(lengths) / seconds,
               "pad_fraction": agent.stats()["pad_fraction"], "micro_batches": len(plan.ranks[0]),
               "largest_micro_batch_tokens": largest,
               "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def measure(cuts: list[str], budget: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = []
    for name in cuts:
        queue = ctx.Queue()
        proc = ctx.Process(target=_run_cut, args=(name, budget, queue))
        proc.start()
        out.append(queue.get(timeout=1800))
        proc.join(timeout=60)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--budget", type=int, default=BUDGET, help="train.max_tokens_per_microbatch of budget/packed")
    parser.add_argument("--cuts", nargs="+", choices=list(CUTS), default=list(CUTS))
    args = parser.parse_args()
    lengths = response_lengths()
    print(f"batch: {SEQS} sequences, prompt {PROMPT}, responses {min(lengths)}..{max(lengths)} tokens "
          f"(median {sorted(lengths)[SEQS // 2]}), {sum(lengths) + SEQS * PROMPT} tokens; budget {args.budget}")
    rows = measure(args.cuts, args.budget)
    base = rows[0]["real_tokens_per_s"]
    print(f"{'cut':8s} {'tokens/s':>9s} {'vs padded':>9s} {'pad frac':>9s} {'micro':>6s} {'largest':>8s} {'peak RSS':>9s}")
    for r in rows:
        print(f"{r['cut']:8s} {r['real_tokens_per_s']:9.0f} {r['real_tokens_per_s'] / base:8.2f}x "
              f"{r['pad_fraction']:9.3f} {r['micro_batches']:6d} {r['largest_micro_batch_tokens']:8d} "
              f"{r['peak_rss_mib']:7.0f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": MODEL, "seqs": SEQS, "budget": args.budget, "cuts": rows}, f, indent=1)


if __name__ == "__main__":
    main()
