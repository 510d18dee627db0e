"""Benchmark of the sequence log-prob kernel: memory and time against the naive path and a bare GEMM.

CPU mode (default)::

    python benchmarks/bench_logprobs.py                 # N=4096,H=512,V=32000 and N=8192,H=1024,V=32000
    python benchmarks/bench_logprobs.py --case 4096,512,32000 --threads 2 --clock wall --repeats 3

Memory: each (case, method) runs in a fresh subprocess. Peak extra memory is the growth of the
process's resident-set high-water mark (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) across one
forward+backward, minus the bytes of the gradients every method must return (dH [N,H] and dW
[V,H]); inputs are generated in place (no transient copies) and a small warm-up runs before the
baseline is read. Time: one more subprocess runs ``--repeats`` rounds, each round timing every
method once (forward+backward, then forward alone under no_grad), and keeps each method's best
time — interleaving makes load from other processes hit all methods alike. The default clock is
the process's CPU time with one torch thread (``--threads 1 --clock cpu``): on a shared machine it
is far less disturbed by other processes than wall time (``--clock wall``).

Methods (fp32 on CPU, bf16 on GPU):
  bare       x = h·Wᵀ, then dH = x·W and dW = xᵀ·h with x standing in for dlogits: 3 GEMMs, 6·N·H·V flop
  naive      logits = h·Wᵀ; log_softmax(logits/T).gather(targets); autograd backward
  reference  sequence_logprobs(impl="reference"): recomputes logits in backward, 8·N·H·V flop
  triton     sequence_logprobs(impl="triton") (GPU mode only)

GPU mode (one short call on a CUDA machine, < 3 minutes)::

    python benchmarks/bench_logprobs.py --gpu           # N=16384, H=4096, V=151936, bf16

measures peak extra CUDA memory with ``torch.cuda.max_memory_allocated`` (same gradient
subtraction), times with CUDA events, and reports TFLOP/s (6NHV for bare/naive, 8NHV with
recompute) and each method's time relative to the bare GEMM fwd+bwd (goal: triton ≥ 70% of the bare
GEMM's rate, i.e. time ≤ 1/0.7 × bare·8/6, and ≥ 20× less extra memory than naive).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
METHODS_CPU = ("bare", "naive", "reference")
METHODS_GPU = ("bare", "naive", "reference", "triton")


def _inputs(n: int, h: int, v: int, dtype, device):
    import torch

    # generated in place on the device: no transient copies that would raise the RSS high-water mark
    # before the baseline is read; logits come out with unit variance
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.empty(n, h, device=device, dtype=dtype).normal_(0.0, h**-0.25, generator=gen).requires_grad_(True)
    weight = torch.empty(v, h, device=device, dtype=dtype).normal_(0.0, h**-0.25, generator=gen).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=gen, device=device)
    seq = min(256, n)  # 256-token responses, the last one takes the remainder
    lengths = torch.full((n // seq,), seq, dtype=torch.int64)
    lengths[-1] += n - int(lengths.sum())
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device)
    grad = torch.randn(n, generator=gen, device=device)
    return hidden, weight, targets, cu, grad


def _step(method: str, hidden, weight, targets, cu, grad, chunk_size):
    import torch

    from hacrl_megatron.kernels import sequence_logprobs

    hidden.grad = weight.grad = None
    if method == "bare":
        with torch.no_grad():
            x = hidden @ weight.t()
            hidden.grad = x @ weight
            weight.grad = x.t() @ hidden
        return
    if method == "naive":
        logits = hidden @ weight.t()
        logp = torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None])[:, 0]
    else:
        logp = sequence_logprobs(hidden, weight, targets, cu, impl=method, chunk_size=chunk_size).token_logps
    (logp * grad).sum().backward()


def _forward(method: str, hidden, weight, targets, cu, chunk_size):
    """Forward only, no graph (the old-log-prob pass of an RL step)."""
    import torch

    from hacrl_megatron.kernels import sequence_logprobs

    with torch.no_grad():
        if method == "bare":
            return hidden @ weight.t()
        if method == "naive":
            return torch.log_softmax((hidden @ weight.t()).float(), dim=-1).gather(1, targets[:, None])[:, 0]
        return sequence_logprobs(hidden, weight, targets, cu, impl=method, chunk_size=chunk_size).token_logps


def _flops(method: str, n: int, h: int, v: int) -> float:
    return (8 if method in ("reference", "triton") else 6) * n * h * v


def _child_cpu_memory(method: str, n: int, h: int, v: int, chunk_size) -> dict:
    """Peak extra RSS of one forward+backward in this fresh process (see the module docstring)."""
    import torch

    hidden, weight, targets, cu, grad = _inputs(n, h, v, torch.float32, "cpu")
    _step(method, *_inputs(64, h, 512, torch.float32, "cpu"), None)  # thread pools, lazy imports
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _step(method, hidden, weight, targets, cu, grad, chunk_size)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grads_bytes = (hidden.numel() + weight.numel()) * 4
    return {"method": method, "extra_mib": max(0.0, (peak - base) * 1024 - grads_bytes) / 2**20}


def _child_cpu_timing(methods: list[str], n: int, h: int, v: int, repeats: int, chunk_size,
                      clock: str = "cpu") -> dict:
    """Best-of-``repeats`` times with the methods interleaved round by round in one process, so that
    load from other processes on the machine hits every method alike (min is the least disturbed).

    ``clock="cpu"`` measures this process's CPU time (``time.process_time``, all threads), which
    other processes competing for the cores inflate far less than wall time; "wall" uses
    ``time.perf_counter``. Use ``--threads 1`` with the CPU clock for the most stable numbers.
    """
    import torch

    now = time.process_time if clock == "cpu" else time.perf_counter
    hidden, weight, targets, cu, grad = _inputs(n, h, v, torch.float32, "cpu")
    step = {m: [] for m in methods}
    fwd = {m: [] for m in methods}
    for _ in range(repeats):
        for m in methods:
            t0 = now()
            _step(m, hidden, weight, targets, cu, grad, chunk_size)
            step[m].append(now() - t0)
            t0 = now()
            _forward(m, hidden, weight, targets, cu, chunk_size)
            fwd[m].append(now() - t0)
    return {m: {"seconds": min(step[m]), "fwd_seconds": min(fwd[m]),
                "gflops": _flops(m, n, h, v) / min(step[m]) / 1e9} for m in methods}


def _child_gpu(method: str, n: int, h: int, v: int, repeats: int, chunk_size) -> dict:
    import torch

    hidden, weight, targets, cu, grad = _inputs(n, h, v, torch.bfloat16, "cuda")
    _step(method, *_inputs(256, h, 1024, torch.bfloat16, "cuda"), None)  # compile / warm up
    _step(method, hidden, weight, targets, cu, grad, chunk_size)  # JIT for these shapes
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _step(method, hidden, weight, targets, cu, grad, chunk_size)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - (hidden.numel() + weight.numel()) * 2
    def timed(fn) -> float:
        out = []
        for _ in range(repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(stop) / 1e3)
        return statistics.median(out)

    sec = timed(lambda: _step(method, hidden, weight, targets, cu, grad, chunk_size))
    fwd = timed(lambda: _forward(method, hidden, weight, targets, cu, chunk_size))
    return {"method": method, "extra_mib": max(0, extra) / 2**20, "seconds": sec, "fwd_seconds": fwd,
            "tflops": _flops(method, n, h, v) / sec / 1e12}


def _run_child(args, method: str, case: tuple[int, int, int], config: str | None = None,
               methods: tuple[str, ...] | list[str] = ()) -> dict:
    env = dict(os.environ)
    if config:
        env["HACRL_LOGPROB_TRITON_CONFIG"] = config
    cmd = [sys.executable, __file__, "--child", method, "--case", ",".join(map(str, case)),
           "--repeats", str(args.repeats), "--threads", str(args.threads), "--clock", args.clock]
    if args.chunk_size:
        cmd += ["--chunk-size", str(args.chunk_size)]
    if methods:
        cmd += ["--methods", ",".join(methods)]
    if args.gpu:
        cmd.append("--gpu")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        return {"method": method, "error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    if method == "timing":
        return json.loads(out.stdout.strip().splitlines()[-1])
    row = json.loads(out.stdout.strip().splitlines()[-1])
    if config:
        row["tag"] = f" [{config}]"
    return row


def _report(case, rows: list[dict], gpu: bool, args) -> None:
    n, h, v = case
    by = {r["method"]: r for r in rows if "error" not in r}
    print(f"\n## N={n} H={h} V={v} ({'bf16, CUDA' if gpu else 'fp32, CPU'})"
          + ("" if gpu else f", {args.threads} thread(s), {args.clock} clock, best of {args.repeats}"))
    rate = "tflops" if gpu else "gflops"
    print(f"| method | extra MiB | fwd+bwd s | {'TFLOP/s' if gpu else 'GFLOP/s'} | time / bare | rate / bare "
          f"| fwd s | fwd time / bare fwd |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['method']} | error: {r['error']} | | | | | | |")
            continue
        bare = by.get("bare")
        rel_t = f"{r['seconds'] / bare['seconds']:.2f}" if bare else "-"
        rel_r = f"{r[rate] / bare[rate]:.2f}" if bare else "-"
        rel_f = f"{r['fwd_seconds'] / bare['fwd_seconds']:.2f}" if bare else "-"
        print(f"| {r['method']}{r.get('tag', '')} | {r['extra_mib']:.1f} | {r['seconds']:.3f} | {r[rate]:.1f} "
              f"| {rel_t} | {rel_r} | {r['fwd_seconds']:.3f} | {rel_f} |")
    if "naive" in by:
        for m in ("reference", "triton"):
            if m in by and by[m]["extra_mib"] > 0:
                print(f"memory: naive / {m} = {by['naive']['extra_mib'] / by[m]['extra_mib']:.1f}x less")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="CUDA mode: bf16, N=16384 H=4096 V=151936")
    p.add_argument("--case", action="append", help="N,H,V (repeatable)")
    p.add_argument("--repeats", type=int, default=3, help="timing rounds (best of)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="CPU mode timer: process CPU time (robust on a shared machine) or wall time")
    p.add_argument("--chunk-size", type=int, default=None, help="kernel chunk_size (tokens); default: auto")
    p.add_argument("--methods", default=None, help="comma list; default all for the mode")
    p.add_argument("--configs", default=None,
                   help="GPU tuning: ';'-separated Triton tile configs BLOCK_M,BLOCK_V,BLOCK_K,SPLIT_V,warps,stages, "
                        "each timed as an extra 'triton' row (sets HACRL_LOGPROB_TRITON_CONFIG in the child)")
    p.add_argument("--json", default=None, help="also write [{case, rows}] as JSON to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("--gpu needs a CUDA device (torch.cuda.is_available() is False here); "
                  "run the CPU mode without --gpu, or run this on a GPU machine.")
            sys.exit(2)
    cases = [tuple(int(x) for x in c.split(",")) for c in args.case] if args.case else (
        [(16384, 4096, 151936)] if args.gpu else [(4096, 512, 32000), (8192, 1024, 32000)])
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        if args.gpu:
            print(json.dumps(_child_gpu(args.child, *cases[0], args.repeats, args.chunk_size)))
        elif args.child == "timing":
            print(json.dumps(_child_cpu_timing(args.methods.split(","), *cases[0], args.repeats, args.chunk_size,
                                               args.clock)))
        else:
            print(json.dumps(_child_cpu_memory(args.child, *cases[0], args.chunk_size)))
        return
    methods = args.methods.split(",") if args.methods else (METHODS_GPU if args.gpu else METHODS_CPU)
    reports = []
    for case in cases:
        rows = [_run_child(args, m, case) for m in methods]
        if args.gpu:
            rows += [_run_child(args, "triton", case, c) for c in (args.configs or "").split(";") if c]
        else:
            timing = _run_child(args, "timing", case, methods=methods)
            for row in rows:
                row.update(timing.get(row["method"], {"error": timing.get("error", "timing failed")}))
        _report(case, rows, args.gpu, args)
        reports.append({"case": list(case), "rows": rows})
        if args.json:  # rewritten after every case: a run cut short still leaves the finished ones
            Path(args.json).write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
