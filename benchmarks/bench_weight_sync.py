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
machine measures the CPU path's overheads, not NCCL bandwidth.

    python benchmarks/bench_weight_sync.py --sglang disk tensor gloo nccl [--repeat 3]

GPU only: a real SGLang server on SmolLM2-135M-Instruct (``$HACRL_SGLANG_PYTHON`` or this Python)
and each transport pushing the model's bf16 weights (``EnginePool.load_weights``); prints seconds
per push and per GB. disk, tensor (CUDA IPC from this process's GPU 0) and gloo share one server on
GPU 0; nccl needs a second GPU for the server (NCCL cannot put two ranks on one GPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hacrl_megatron.net import free_port  # noqa: E402
from hacrl_megatron.sync.base import buckets  # noqa: E402
from hacrl_megatron.sync.weight_group import (  # noqa: E402
    broadcast_async,
    flatten_bucket,
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


def _sglang_server(gpu: int, log: str):
    from hacrl_megatron.models.smollm2 import smollm2_hf_dir
    from hacrl_megatron.rollout import SGLangServer

    return SGLangServer(smollm2_hf_dir(), gpu_ids=[gpu], mem_fraction_static=0.3, extra_args=["--enable-memory-saver"],
                        log_path=log, python=os.environ.get("HACRL_SGLANG_PYTHON") or sys.executable)


def _transport(mode: str, sync_dir: str):
    from hacrl_megatron.sync.disk import DiskTransport
    from hacrl_megatron.sync.distributed import DistributedTransport
    from hacrl_megatron.sync.tensor import TensorTransport

    if mode == "disk":
        return DiskTransport(sync_dir)
    if mode == "tensor":
        return TensorTransport(256 << 20)
    return DistributedTransport(256 << 20, backend="nccl" if mode == "nccl" else "gloo", group_name=f"bench_{mode}")


def sglang_bench(modes: list[str], repeat: int) -> None:
    """Seconds per push of SmolLM2's bf16 weights into a real SGLang server, per transport."""
    from transformers import AutoModelForCausalLM

    from hacrl_megatron.exchange import load_tokenizer
    from hacrl_megatron.models.smollm2 import smollm2_hf_dir
    from hacrl_megatron.rollout import EnginePool, SamplingParams, SGLangEngine

    folder, work = smollm2_hf_dir(), tempfile.mkdtemp(prefix="bench_sglang_")
    tok = load_tokenizer(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).to("cuda:0")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    gb = sum(v.numel() * v.element_size() for v in state.values()) / 1e9
    prompt = tok("What is 2+3?", add_special_tokens=False)["input_ids"]
    print(f"SmolLM2-135M bf16: {len(state)} tensors, {gb:.3f} GB; {torch.cuda.get_device_name(0)}")
    print(f"{'transport':>10} {'s/push (best)':>14} {'s/GB':>8}")
    servers = {}
    for mode in modes:
        gpu = 1 if mode == "nccl" else 0
        if gpu >= torch.cuda.device_count():
            print(f"{mode:>10} skipped: needs GPU {gpu} for the server")
            continue
        if gpu not in servers:
            servers[gpu] = _sglang_server(gpu, os.path.join(work, f"server{gpu}.log"))
            servers[gpu].start()
        engine = SGLangEngine(servers[gpu].base_url, eos_token_id=tok.eos_token_id, tokenizer=tok)
        pool = EnginePool([engine], _transport(mode, os.path.join(work, "sync")), name=mode)
        weights = state if mode in ("tensor", "nccl") else {k: v.cpu() for k, v in state.items()}
        greedy = SamplingParams(temperature=0, max_new_tokens=16)
        before = pool.generate([prompt], greedy)
        times = []
        for _ in range(repeat):
            torch.cuda.synchronize()
            start = time.perf_counter()
            pool.load_weights(weights.items())
            times.append(time.perf_counter() - start)
        ok = pool.generate([prompt], greedy) == before  # the same weights pushed: same greedy answer
        pool.transport.close()
        print(f"{mode:>10} {min(times):>14.3f} {min(times) / gb:>8.2f}" + ("" if ok else "  (greedy output changed!)"))
    for server in servers.values():
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--buckets-mb", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sglang", nargs="*", choices=["disk", "tensor", "gloo", "nccl"],
                        help="GPU: time these transports into a real SGLang server instead")
    args = parser.parse_args()
    if args.sglang:
        return sglang_bench(args.sglang, args.repeat)
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
