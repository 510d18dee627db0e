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

    python benchmarks/bench_weight_sync.py --stages [--hidden 1024] [--layers 8] [--stage-bucket-mb 64]

The stage-parallel path (sync/stages.py) against the rank-0 funnel (sync/distributed.py), both the
package's own code end to end on gloo: a TP = 2 · PP = 2 trainer world (four processes holding each
weight's TP shards) pushes into one stand-in SGLang server (tests/fixtures/fake_sglang_server.py, in
this process, an HF Llama of the same shapes in bf16). The funnel: every rank runs the full export
(each tensor all-gathered over its stage's TP group, then broadcast over the pipeline group to the
other stage) and rank 0 pushes it through ``push_from_rank``. The stages: each stage's TP group
gathers its own tensors only and each stage's first rank pushes them through its
``StageSender`` (its own weight group, turns on the engine through the world's store); rank 0 holds
the server's session around both, as the controller does. Prints seconds per push and per GB (best
of ``--repeat``, after one warm-up push that forms the groups) and the bytes each rank held and sent.

    python benchmarks/bench_weight_sync.py --sglang disk tensor gloo nccl [--repeat 3]

GPU only: a real SGLang server on SmolLM2-135M-Instruct (``$HACRL_SGLANG_PYTHON`` or this Python)
and each transport pushing the model's bf16 weights (``EnginePool.load_weights``); prints seconds
per push and per GB. disk, tensor (CUDA IPC from this process's GPU 0) and gloo share one server on
GPU 0; nccl needs a second GPU for the server (NCCL cannot put two ranks on one GPU).
"""

from __future__ import annotations

import argparse
import contextlib
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


# --------------------------------------------------------------------------------------------
# stage-parallel push vs the rank-0 funnel (--stages)

STAGE_TP, STAGE_PP = 2, 2


def stage_of(name: str, layers: int) -> int:
    """Pipeline stage (of two) owning an HF tensor: the embedding and the first half of the layers on 0."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) * STAGE_PP // layers
    return 0 if name == "model.embed_tokens.weight" else STAGE_PP - 1


def _gather_own(name: str, shape: tuple[int, ...], rank: int, tp_group) -> torch.Tensor:
    """The full tensor from this TP rank's shard and its peer's (1-D weights are replicated)."""
    full = torch.empty(shape, dtype=torch.bfloat16)
    if len(shape) == 1:
        return full.fill_(1.0)
    shard = torch.full((shape[0] // STAGE_TP, *shape[1:]), float(rank % STAGE_TP + 1), dtype=torch.bfloat16)
    torch.distributed.all_gather(list(full.split(shape[0] // STAGE_TP)), shard, group=tp_group)
    return full


def funnel_stream(shapes, layers: int, rank: int, tp_group, pp_group):
    """What ``export_hf_weights`` does per tensor on every rank: the owning stage gathers, then a
    pipeline broadcast hands the tensor to the other stage."""
    stage = rank // STAGE_TP
    for name, shape in shapes:
        owner = stage_of(name, layers)
        full = _gather_own(name, shape, rank, tp_group) if owner == stage else torch.empty(shape, dtype=torch.bfloat16)
        torch.distributed.broadcast(full, src=owner * STAGE_TP + rank % STAGE_TP, group=pp_group)
        yield name, full


def stage_stream(shapes, layers: int, rank: int, tp_group):
    """What ``export_stage_hf_weights`` does: this stage's tensors only, gathered within the stage."""
    for name, shape in shapes:
        if stage_of(name, layers) == rank // STAGE_TP:
            yield name, _gather_own(name, shape, rank, tp_group)


class _Counted:
    def __init__(self, stream) -> None:
        self.stream, self.bytes = stream, 0

    def __iter__(self):
        for name, t in self.stream:
            self.bytes += t.numel() * t.element_size()
            yield name, t


def _stage_worker(rank: int, world: int, init_file: str, args, url: str, results) -> None:
    import torch.distributed as dist

    from hacrl_megatron.rollout import SGLangEngine
    from hacrl_megatron.sync.base import weight_update_session
    from hacrl_megatron.sync.distributed import DistributedTransport, push_from_rank
    from hacrl_megatron.sync.stages import StageRole, StageSenderFactory

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    tp_groups = [dist.new_group([s * STAGE_TP + t for t in range(STAGE_TP)]) for s in range(STAGE_PP)]
    pp_groups = [dist.new_group([s * STAGE_TP + t for s in range(STAGE_PP)]) for t in range(STAGE_TP)]
    tp_group, pp_group = tp_groups[rank // STAGE_TP], pp_groups[rank % STAGE_TP]
    shapes, bucket = llama_shapes(args.hidden, args.layers), args.stage_bucket_mb << 20
    engine = SGLangEngine(url, eos_token_id=0, name="engine0", timeout=600)
    funnel = DistributedTransport(bucket, backend="gloo", group_name="bench_funnel") if rank == 0 else None
    roles = tuple(StageRole(r, r // STAGE_TP, STAGE_PP, sends=r % STAGE_TP == 0, exports=True) for r in range(world))
    sender = StageSenderFactory(roles, bucket, "gloo", "bench_stages", None, 600.0, {}, "bench_turns")(rank)
    for path in ("funnel", "stages"):
        for attempt in range(args.repeat + 1):  # the first push forms the groups: not timed
            dist.barrier()
            start = time.perf_counter()
            if path == "funnel":
                stream = _Counted(funnel_stream(shapes, args.layers, rank, tp_group, pp_group))
                before = funnel.bytes_sent if funnel else 0
                push_from_rank(stream, funnel, [engine], version=attempt)
                sent = funnel.bytes_sent - before if funnel else 0
            else:
                stream = _Counted(stage_stream(shapes, args.layers, rank, tp_group))
                with weight_update_session([engine]) if rank == 0 else contextlib.nullcontext():
                    dist.barrier()  # the controller's session is open before any stage sends
                    sender.push(stream, [engine], version=attempt)
                    dist.barrier()
                sent = sender.last_bytes_sent
            dist.barrier()
            if attempt:
                results.put((path, rank, time.perf_counter() - start, stream.bytes, sent))
    if funnel is not None:
        funnel.close()
    sender.close()
    dist.destroy_process_group()


def stages_bench(args) -> None:
    """Seconds per GB of the stage-parallel push and of the rank-0 funnel (module docstring)."""
    from types import SimpleNamespace

    import torch.multiprocessing as mp
    from transformers import LlamaConfig, LlamaForCausalLM

    from hacrl_megatron.models.parallel import local_rendezvous
    from hacrl_megatron.rollout import HFEngine
    from tests.fixtures.sglang_standin import StandIn

    ffn = int(args.hidden * 2.75) // 64 * 64
    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=ffn, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64,
                         tie_word_embeddings=False)
    shapes = llama_shapes(args.hidden, args.layers)
    gb = sum(torch.Size(s).numel() * 2 for _, s in shapes) / 1e9
    share = [sum(torch.Size(s).numel() * 2 for n, s in shapes if stage_of(n, args.layers) == k) / 1e9
             for k in range(STAGE_PP)]
    server = StandIn(lambda: HFEngine(LlamaForCausalLM(config).to(torch.bfloat16),
                                      SimpleNamespace(eos_token_id=0, pad_token_id=0)))
    server.start()
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab 32000, bf16: {len(shapes)} tensors, {gb:.3f} GB "
          f"(stage shares {share[0]:.3f} + {share[1]:.3f} GB); TP{STAGE_TP}·PP{STAGE_PP} gloo world -> 1 stand-in "
          f"SGLang server; buckets {args.stage_bucket_mb} MiB; torch {torch.__version__}, {os.cpu_count()} CPUs")
    results = mp.get_context("spawn").SimpleQueue()
    try:
        with local_rendezvous("bench_stages_") as init_file:
            mp.spawn(_stage_worker, args=(STAGE_TP * STAGE_PP, init_file, args, server.base_url, results),
                     nprocs=STAGE_TP * STAGE_PP, join=True)
    finally:
        server.stop()
    runs: dict[str, dict[int, list[tuple[float, int, int]]]] = {}
    while not results.empty():
        path, rank, seconds, held, sent = results.get()
        runs.setdefault(path, {}).setdefault(rank, []).append((seconds, held, sent))
    print(f"{'path':>8} {'s/push (best)':>14} {'s/GB':>8} {'GB/s':>6}   per rank: GB held / GB sent")
    for path in ("funnel", "stages"):
        per_rank = runs[path]
        best = min(max(per_rank[r][k][0] for r in per_rank) for k in range(args.repeat))  # a push ends with its last rank
        ranks = "  ".join(f"r{r} {per_rank[r][0][1] / 1e9:.3f}/{per_rank[r][0][2] / 1e9:.3f}" for r in sorted(per_rank))
        print(f"{path:>8} {best:>14.3f} {best / gb:>8.2f} {gb / best:>6.2f}   {ranks}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--buckets-mb", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sglang", nargs="*", choices=["disk", "tensor", "gloo", "nccl"],
                        help="GPU: time these transports into a real SGLang server instead")
    parser.add_argument("--stages", action="store_true",
                        help="the stage-parallel push vs the rank-0 funnel from a TP2·PP2 gloo world instead")
    parser.add_argument("--stage-bucket-mb", type=int, default=64, help="--stages: MiB per bucket")
    args = parser.parse_args()
    if args.sglang:
        return sglang_bench(args.sglang, args.repeat)
    if args.stages:
        return stages_bench(args)
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
