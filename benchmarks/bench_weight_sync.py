"""Weight-sync throughput of the gather → bucket → broadcast path (sync/distributed.py) on CPU, vs bucket size.

    python benchmarks/bench_weight_sync.py [--hidden 1024] [--layers 8] [--buckets-mb 1 4 16 64 256]

Three processes, as in a TP = 2 agent syncing one engine: trainer ranks 0 and 1 hold each
weight's two TP shards and all-gather it over their own gloo group (what ``export_hf_weights``
does per tensor); rank 0 cuts the stream into buckets (``sync.base.buckets``), flattens each
(``flatten_bucket``) and broadcasts it over a separate weight group to the receiver (the group is
made by ``init_weight_group``, SGLang's rendezvous), overlapping the gather of bucket k+1 with the
broadcast of bucket k exactly as ``DistributedTransport.push`` does; the receiver slices each
bucket back into tensors. The weights are a Llama-shaped bf16 model (``--hidden``, ``--layers``,
vocabulary 32000). Prints, per bucket size: seconds per sync, MB/s, number of buckets; and the
bucket+flatten cost alone in one process (no collective). Loopback gloo on a shared 2-core
machine measures the CPU path's overheads, not NCCL bandwidth (that is benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hacrl_megatron.sync.base import buckets  # noqa: E402
from hacrl_megatron.sync.distributed import (  # noqa: E402
    broadcast_async,
    flatten_bucket,
    free_port,
    init_weight_group,
    unflatten_bucket,
)


def llama_shapes(hidden: int, layers: int, vocab: int = 32000) -> list[tuple[str, tuple[int, ...]]]:
    ffn = int(hidden * 2.75) // 64 * 64
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.k_proj.weight", (hidden, hidden)),
                   (p + "self_attn.v_proj.weight", (hidden, hidden)), (p + "self_attn.o_proj.weight", (hidden, hidden)),
                   (p + "mlp.gate_proj.weight", (ffn, hidden)), (p + "mlp.up_proj.weight", (ffn, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, ffn)), (p + "input_layernorm.weight", (hidden,)),
                   (p + "post_attention_layernorm.weight", (hidden,))]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def gathered_stream(shapes, rank: int, group):
    """Each weight split in two along dim 0 (the TP shards), all-gathered, yielded whole."""
    for name, shape in shapes:
        full = torch.empty(shape, dtype=torch.bfloat16)
        if len(shape) == 1:
            yield name, full.fill_(1.0)
            continue
        shard = torch.full((shape[0] // 2, *shape[1:]), float(rank + 1), dtype=torch.bfloat16)
        parts = list(full.split(shape[0] // 2))
        torch.distributed.all_gather(parts, shard, group=group)
        yield name, full


def _metas(shapes, bucket_bytes: int):
    zeros = ((n, torch.empty(s, dtype=torch.bfloat16, device="meta")) for n, s in shapes)
    return [{"names": [n for n, _ in b], "dtypes": ["bfloat16"] * len(b), "shapes": [list(t.shape) for _, t in b],
             "size": sum(t.numel() * 2 for _, t in b)} for b in buckets(zeros, bucket_bytes)]


def _worker(rank: int, args, init_file: str, port: int, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    shapes = llama_shapes(args.hidden, args.layers)
    trainer = None
    if rank < 2:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        trainer = dist.group.WORLD
    weight = init_weight_group("127.0.0.1", port, 0 if rank == 0 else 1, 2, "bench", "gloo") if rank != 1 else None
    for mb in args.buckets_mb:
        bucket_bytes = mb << 20
        for _ in range(args.repeat):
            if trainer is not None:
                dist.barrier(group=trainer)
            start = time.perf_counter()
            if rank == 2:  # the engine: receive and slice every bucket
                for meta in _metas(shapes, bucket_bytes):
                    flat = torch.empty(meta["size"], dtype=torch.uint8)
                    broadcast_async(weight, flat).wait()
                    unflatten_bucket(flat, meta["names"], meta["dtypes"], meta["shapes"])
                continue
            stream = gathered_stream(shapes, rank, trainer)
            if rank == 1:  # only advances the collective stream
                for _ in stream:
                    pass
                continue
            inflight, count = None, 0
            for bucket in buckets(stream, bucket_bytes):
                flat, _ = flatten_bucket(bucket)  # gathered while the previous bucket is on the wire
                if inflight is not None:
                    inflight.wait()
                inflight, count = broadcast_async(weight, flat), count + 1
            inflight.wait()
            results.put((mb, time.perf_counter() - start, count))
    if weight is not None:
        dist.destroy_process_group(weight)
    if trainer is not None:
        dist.destroy_process_group()


def bucket_only(shapes, mb: int) -> float:
    stream = [(n, torch.ones(s, dtype=torch.bfloat16)) for n, s in shapes]
    start = time.perf_counter()
    for bucket in buckets(stream, mb << 20):
        flatten_bucket(bucket)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--buckets-mb", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    shapes = llama_shapes(args.hidden, args.layers)
    total_mb = sum(torch.Size(s).numel() * 2 for _, s in shapes) / 2**20
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab 32000, bf16: {len(shapes)} tensors, "
          f"{total_mb:.0f} MiB; torch {torch.__version__}, {os.cpu_count()} CPUs")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    init_file = os.path.join(tempfile.mkdtemp(prefix="bench_sync_"), "rendezvous")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, args, init_file, port, results)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    runs: dict[int, list[tuple[float, int]]] = {}
    while not results.empty():
        mb, seconds, count = results.get()
        runs.setdefault(mb, []).append((seconds, count))
    print(f"{'bucket MiB':>10} {'buckets':>8} {'s/sync (best)':>14} {'MiB/s':>8} {'bucket+flatten only MiB/s':>26}")
    for mb in args.buckets_mb:
        best, count = min(runs[mb])
        alone = bucket_only(shapes, mb)
        print(f"{mb:>10} {count:>8} {best:>14.3f} {total_mb / best:>8.0f} {total_mb / alone:>26.0f}")


if __name__ == "__main__":
    main()
