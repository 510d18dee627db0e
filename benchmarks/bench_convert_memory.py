"""Peak RSS of ``hacrl convert`` at TP=2 x PP=2 on a synthetic multi-shard checkpoint, against its size.

    python benchmarks/bench_convert_memory.py                 # ~0.3 GB checkpoint (the test's size)
    python benchmarks/bench_convert_memory.py --hidden 4096   # ~2.6 GB, wide and shallow

Writes a random Llama-shaped bf16 checkpoint (wide and shallow: a large hidden size, two layers, the
Llama-3 vocabulary) as several safetensors shards, converts it HF -> Megatron and Megatron -> HF
with ``python -m hacrl_megatron convert`` at TP=2 x PP=2 (four spawned ranks), and prints, per
direction, the peak resident set of the largest process of the job (``getrusage(RUSAGE_CHILDREN)``
of a fresh parent, so nothing else is counted) next to the checkpoint and shard sizes. A tiny
model's conversion gives the fixed overhead (Python, torch, megatron-core imports, the gloo world).

The streaming bound (tests/unit/test_convert_memory.py asserts it): a rank never holds more than
its own parameters plus the tensors it is reading or writing: on import one HF tensor's slice and
its converted copy; on export rank 0's output bucket of ``--max-shard-gb`` and safetensors'
serialised copy of it, and one tensor in flight (its gathered TP shards and the HF tensor made from
them), so ``peak - overhead <= rank parameters + 2 x largest shard + 2 x largest tensor``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MEASURE = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
            "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)")


def write_checkpoint(folder: str, *, hidden: int, layers: int = 2, vocab: int = 128256, shard_mb: int = 100,
                     seed: int = 0) -> dict[str, int]:
    """A random Llama-shaped bf16 HF checkpoint in ``folder`` (config.json + sharded safetensors).

    One tensor at a time is made and written, so writing never holds the whole model. Returns
    sizes in bytes: total, largest shard, largest tensor, and the parameter count."""
    import torch
    from safetensors.torch import save_file

    heads = max(4, hidden // 128)
    kv_heads = 4 if heads >= 8 and heads % 4 == 0 else 2
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
           "intermediate_size": 4 * hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "vocab_size": vocab,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    kv = kv_heads * (hidden // heads)
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (4 * hidden, hidden), p + "mlp.up_proj.weight": (4 * hidden, hidden),
                       p + "mlp.down_proj.weight": (hidden, 4 * hidden)})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    gen = torch.Generator().manual_seed(seed)
    weight_map, bucket, size, shards, largest_tensor = {}, {}, 0, [], 0

    def flush() -> None:
        nonlocal bucket, size
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(bucket, os.path.join(folder, name), metadata={"format": "pt"})
        shards.append(os.path.getsize(os.path.join(folder, name)))
        weight_map.update(dict.fromkeys(bucket, name))
        bucket, size = {}, 0

    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if size and size + t.numel() * 2 > shard_mb << 20:
            flush()
        bucket[name] = t
        size += t.numel() * 2
        largest_tensor = max(largest_tensor, t.numel() * 2)
    flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(shards)}, "weight_map": weight_map}, f)
    params = sum(int(torch.Size(s).numel()) for s in shapes.values())
    return {"total": sum(shards), "largest_shard": max(shards), "largest_tensor": largest_tensor, "params": params}


def peak_rss(argv: list[str]) -> tuple[int, float]:
    """(peak RSS in bytes of the largest process that ``argv`` and its children ran, seconds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _MEASURE, *argv], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("PEAK_RSS_KB")]
    if not line or line[-1].split()[2] != "0":
        raise RuntimeError(f"{' '.join(argv)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return int(line[-1].split()[1]) * 1024, seconds


def convert_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "hacrl_megatron", "convert", *args]


def measure(workdir: str, hidden: int, shard_mb: int, tp: int = 2, pp: int = 2, vocab: int = 128256) -> dict[str, float]:
    """Both directions at ``tp`` x ``pp`` for one checkpoint size; sizes and peaks in bytes."""
    hf = os.path.join(workdir, f"hf_{hidden}")
    sizes = write_checkpoint(hf, hidden=hidden, shard_mb=shard_mb, vocab=vocab)
    mg, back = os.path.join(workdir, f"mg_{hidden}"), os.path.join(workdir, f"back_{hidden}")
    layout = ["--tp", str(tp), "--pp", str(pp)]
    imp, t_imp = peak_rss(convert_argv("--from-hf", hf, "--to-megatron", mg, *layout))
    exp, t_exp = peak_rss(convert_argv("--from-megatron", mg, "--to-hf", back, *layout,
                                       "--max-shard-gb", f"{shard_mb / 1024:g}"))
    return {**sizes, "import_peak": imp, "export_peak": exp, "import_s": t_imp, "export_s": t_exp,
            "rank_params_bytes": rank_param_bytes(hf, tp, pp)}


def rank_param_bytes(hf_dir: str, tp: int, pp: int) -> int:
    """bf16 bytes of the largest rank's parameters (the planner's exact per-rank count)."""
    from hacrl_megatron.plan.params import arch_from_config, stage_params

    return 2 * max(stage_params(arch_from_config(hf_dir), tp, pp))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[1536], help="hidden sizes to measure (4 h MLP)")
    p.add_argument("--shard-mb", type=int, default=100, help="safetensors shard size of the synthetic checkpoint")
    args = p.parse_args(argv)
    mib = 2**20
    with tempfile.TemporaryDirectory(prefix="hacrl_bench_convert_") as tmp:
        base = measure(tmp, 64, 1, vocab=1024)
        print(f"fixed overhead (hidden 64, {base['total'] / mib:.0f} MiB): import peak {base['import_peak'] / mib:.0f} "
              f"MiB, export peak {base['export_peak'] / mib:.0f} MiB")
        print(f"{'hidden':>6s} {'ckpt MiB':>9s} {'shard MiB':>9s} {'rank MiB':>8s} {'import MiB':>10s} "
              f"{'export MiB':>10s} {'bound MiB':>9s} {'import s':>8s} {'export s':>8s}")
        for hidden in args.hidden:
            r = measure(tmp, hidden, args.shard_mb)
            over = max(base["import_peak"], base["export_peak"])
            bound = over + r["rank_params_bytes"] + 2 * r["largest_shard"] + 2 * r["largest_tensor"]
            print(f"{hidden:6d} {r['total'] / mib:9.0f} {r['largest_shard'] / mib:9.0f} "
                  f"{r['rank_params_bytes'] / mib:8.0f} {r['import_peak'] / mib:10.0f} {r['export_peak'] / mib:10.0f} "
                  f"{bound / mib:9.0f} {r['import_s']:8.1f} {r['export_s']:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
