"""Megatron agent throughput on CPU: forward+backward tokens/s at TP = 1/2, PP = 1/2; SmolLM2 conversion time.

    python benchmarks/bench_megatron.py                 # all layouts, both tiny presets
    python benchmarks/bench_megatron.py --smollm2       # also time SmolLM2-135M HF -> Megatron
    python benchmarks/bench_megatron.py --write benchmarks/RESULTS_megatron.md

Each layout runs as its own world (``mp.spawn`` of tp*pp gloo ranks, 1 torch thread per rank; the
TP = PP = 1 case runs as 1 rank with 1 thread). A step is one ``LocalAgent.train`` update on a
mini-batch of 16 sequences of 64 tokens (micro-batches of 8, AdamW, grad clip) — the agent's real
code path; "fwd" is ``sequence_logprobs`` on the same batch. The first update is a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the calibrated CPU-demo agents (docs/measured.md §8) and a wider-vocab one
PRESETS = {
    "llama_h128_l4_v32": dict(arch="llama", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4,
                              ffn_hidden_size=512, vocab_size=32),
    "qwen3_h96_l2_v200": dict(arch="qwen3", hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                              ffn_hidden_size=384, vocab_size=200),
    "llama_h128_l4_v32000": dict(arch="llama", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4,
                                 ffn_hidden_size=512, vocab_size=32000),
}
LAYOUTS = [(1, 1), (2, 1), (1, 2)]
SEQS, SEQ_LEN, PROMPT, MICRO, STEPS = 16, 64, 16, 8, 5


def _batch(vocab: int):
    from hacrl_megatron.agents.batch import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids = tuple(torch.randint(0, vocab, (SEQ_LEN,), generator=g) for _ in range(SEQS))
    return SequenceBatch(input_ids=ids, prompt_lens=torch.full((SEQS,), PROMPT))


def _loss(lp, inputs, info):
    return -(lp.seq_logp_sum / lp.seq_len).sum() / info.num_sequences, {}


def _measure(rank: int, preset: str, tp: int, pp: int, out: str) -> None:
    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.config import AgentConfig, ModelConfig, ParallelConfig, TrainConfig

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cfg = AgentConfig(name="bench", model=ModelConfig(**PRESETS[preset]), lr=1e-4, parallel=ParallelConfig(tp=tp, pp=pp))
    agent = LocalAgent(cfg, TrainConfig(micro_batch_size=MICRO))
    batch = _batch(PRESETS[preset]["vocab_size"])
    agent.train([batch], _loss)  # warm-up
    t0 = time.perf_counter()
    agent.train([batch] * STEPS, _loss)
    train_s = (time.perf_counter() - t0) / STEPS
    t0 = time.perf_counter()
    for _ in range(STEPS):
        agent.sequence_logprobs(batch)
    fwd_s = (time.perf_counter() - t0) / STEPS
    if rank == 0:
        tokens = SEQS * SEQ_LEN
        with open(out, "w") as f:
            json.dump({"preset": preset, "tp": tp, "pp": pp, "params": agent.num_parameters(),
                       "train_tok_s": tokens / train_s, "step_ms": 1e3 * train_s, "fwd_tok_s": tokens / fwd_s}, f)


def _spawned(rank: int, world: int, init_file: str, preset: str, tp: int, pp: int, out: str) -> None:
    from hacrl_megatron.models.parallel import local_world_env, shutdown_parallel

    os.environ.update(local_world_env(rank, world, init_file))
    _measure(rank, preset, tp, pp, out)
    shutdown_parallel()


def run_layout(preset: str, tp: int, pp: int) -> dict:
    from hacrl_megatron.models.parallel import spawn_local_world

    with tempfile.TemporaryDirectory(prefix="bench_mg_") as folder:
        out = os.path.join(folder, "r.json")
        # every layout in fresh processes (megatron's parallel state is one per process)
        spawn_local_world(_spawned, tp * pp, (preset, tp, pp, out), prefix="bench_mg_world_")
        with open(out) as f:
            return json.load(f)


def smollm2_conversion() -> dict:
    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.config import AgentConfig, ModelConfig, TrainConfig
    from hacrl_megatron.models.smollm2 import smollm2_hf_dir

    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    smollm2_hf_dir()  # GGUF -> HF folder (cached after the first run; not timed here)
    t0 = time.perf_counter()
    agent = LocalAgent(AgentConfig(name="s", model=ModelConfig(arch="llama", hf_path="smollm2")), TrainConfig())
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = sum(t.numel() for _, t in agent.export_hf_weights())
    export_s = time.perf_counter() - t0
    return {"params": n, "hf_to_megatron_s": load_s, "megatron_to_hf_stream_s": export_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="*", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--smollm2", action="store_true", help="also time the SmolLM2-135M conversion")
    p.add_argument("--write", help="write a markdown table to this file")
    args = p.parse_args()
    rows = []
    for preset in args.presets:
        for tp, pp in LAYOUTS:
            r = run_layout(preset, tp, pp)
            rows.append(r)
            print(f"{preset:22s} tp={tp} pp={pp} params={r['params']:>9,d} train {r['train_tok_s']:8.0f} tok/s "
                  f"({r['step_ms']:.0f} ms/update)  fwd {r['fwd_tok_s']:8.0f} tok/s", flush=True)
    smol = smollm2_conversion() if args.smollm2 else None
    if smol:
        print(f"SmolLM2-135M ({smol['params']:,d} params): HF -> Megatron {smol['hf_to_megatron_s']:.1f} s, "
              f"Megatron -> HF stream {smol['megatron_to_hf_stream_s']:.1f} s")
    if args.write:
        write_markdown(args.write, rows, smol)


def write_markdown(path: str, rows: list[dict], smol: dict | None) -> None:
    load = os.getloadavg()[0]
    lines = ["# Megatron agent throughput on CPU (benchmarks/bench_megatron.py)", "",
             f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}; 1 torch thread per rank; "
             f"1-minute load average {load:.1f} at the end of the run (other jobs shared the cores).",
             "Update = 16 sequences x 64 tokens, micro-batch 8, AdamW + grad clip; fwd = sequence_logprobs.", "",
             "| preset | tp | pp | params | train tokens/s | ms/update | fwd tokens/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['tp']} | {r['pp']} | {r['params']:,d} | {r['train_tok_s']:.0f} | "
                     f"{r['step_ms']:.0f} | {r['fwd_tok_s']:.0f} |")
    if smol:
        lines += ["", f"SmolLM2-135M-Instruct ({smol['params']:,d} parameters, 2 threads): HF folder -> Megatron "
                  f"agent (provider + streamed load) {smol['hf_to_megatron_s']:.1f} s; Megatron -> HF tensor stream "
                  f"{smol['megatron_to_hf_stream_s']:.1f} s."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
