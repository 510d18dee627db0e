"""The steps of ``benchmarks/gpu_check.sh``, one per call: ``python benchmarks/gpu_check_steps.py STEP``.

Each step prints what it measures, then its outcome as the last line ``RESULT: <one line>``
("skipped: <why>" when it cannot run here, "FAILED: <what>" when a check fails) and merges its
numbers into ``$OUT/results.json``. Needs only the machine's Python with torch and triton, this
repository, and the wheels carried in ``.whl/`` (megatron-core; see gpu_check.sh's header), which
the ``wheels`` step unpacks into ``$GPU_CHECK_SITE`` for the packages that do not import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules below, however this is run
from gpu_check_common import (  # noqa: E402
    OUT,
    ROOT,
    SITE,
    WHEELS,
    Failed,
    Skip,
    check,
    err,
    importable,
    need_cuda,
    record,
)
from gpu_check_megatron import step_agent, step_megatron, step_megatron_cpu  # noqa: E402

# what the CUDA steps import besides torch: it must import without megatron-core, TE, Ray, SGLang, vLLM
STEP_IMPORTS = ("hacrl_megatron.kernels", "hacrl_megatron.kernels.triton_impl", "hacrl_megatron.algo",
                "hacrl_megatron.config", "hacrl_megatron.sync.cuda_ipc", "hacrl_megatron.models.provider")

# --------------------------------------------------------------------------------------------
# machine and carried wheels


def step_env() -> str:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "triton": getattr(__import__("triton"), "__version__", "?") if importable("triton") else None,
            "present": {m: importable(m) for m in ("numpy", "yaml", "packaging", "megatron", "transformer_engine",
                                                    "ray", "sglang", "vllm", "transformers", "pytest")},
            "wheels": sorted(p.name for p in WHEELS.glob("*.whl"))}
    if torch.cuda.is_available():
        info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()[:3]))
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        info["nvidia_smi"] = smi.stdout.strip()
    broken = []
    for module in STEP_IMPORTS:
        try:
            importlib.import_module(module)
        except ImportError as e:
            broken.append(f"{module}: {e}")
    info["step_imports_failed"] = broken
    record("env", info)
    check(not broken, f"the steps' imports fail here: {'; '.join(broken)}")
    missing = [m for m in ("numpy", "yaml", "packaging") if not info["present"][m]]
    return (f"python {info['python']}, torch {info['torch']} (CUDA {info['cuda']}), triton {info['triton']}, "
            f"{info['device'] or 'no CUDA device'}; carried wheels: {len(info['wheels'])}"
            + (f"; missing: {', '.join(missing)}" if missing else ""))


def top_level(wheel: Path) -> set[str]:
    """Top-level import names of a wheel (its ``*.dist-info/top_level.txt``, else its folders)."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        listed = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        if listed:
            return {t.strip() for t in z.read(listed[0]).decode().splitlines() if t.strip()}
        return {n.split("/")[0].removesuffix(".py") for n in names if ".dist-info" not in n.split("/")[0]
                and not n.split("/")[0].endswith(".data")}


def step_wheels() -> str:
    """Unpack each carried wheel whose packages do not import here into ``$GPU_CHECK_SITE``."""
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        record("wheels", {"unpacked": [], "present": []})
        return "no wheels carried in .whl/ (the megatron-core steps will skip; see the header)"
    unpacked, present = [], []
    SITE.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        names = top_level(wheel)
        if all(importable(n) for n in names):
            present.append(wheel.name)
            continue
        with zipfile.ZipFile(wheel) as z:
            z.extractall(SITE)  # a wheel is a zip of its site-packages tree: no pip, no network
        unpacked.append(wheel.name)
    record("wheels", {"unpacked": unpacked, "present": present, "site": str(SITE)})
    return f"unpacked {len(unpacked)} into {SITE} ({', '.join(unpacked) or '-'}); already importable: {len(present)}"


# --------------------------------------------------------------------------------------------
# the log-prob kernel


def kernel_case(n: int, h: int, v: int, lens: list[int], dtype, seed: int = 0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.empty(n, h, device="cuda", dtype=dtype).normal_(0, h**-0.25, generator=g).requires_grad_(True)
    weight = torch.empty(v, h, device="cuda", dtype=dtype).normal_(0, h**-0.25, generator=g).requires_grad_(True)
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    return hidden, weight, targets, cu


LENS = [1, 199, 300, 17, 483]  # N = 1000 tokens, offsets that are not multiples of any tile


def step_kernel() -> str:
    """Triton vs the reference backend (fp32, bf16; T = 1, 0.7): values and gradients; fp32 also
    against float64 full logits; the fused HACPO loss through both."""
    need_cuda()
    import torch

    from hacrl_megatron.kernels import sequence_logprobs

    out, worst = {}, []
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        for temperature in (1.0, 0.7):
            case = kernel_case(1000, 256, 5003, LENS, dtype)
            up = torch.linspace(-1, 1, 1000, device="cuda")
            res = {}
            for impl in ("triton", "reference"):
                lp = sequence_logprobs(*case, temperature=temperature, impl=impl)
                res[impl] = (lp, *torch.autograd.grad((lp.token_logps * up).sum() + lp.seq_logp_sum.sum(), case[:2]))
            (a, dha, dwa), (b, dhb, dwb) = res["triton"], res["reference"]
            row = {"logp": err(a.token_logps, b.token_logps), "dh": err(dha, dhb), "dw": err(dwa, dwb)}
            if dtype == torch.float32:
                h64, w64 = case[0].detach().double(), case[1].detach().double()
                full = torch.log_softmax((h64 @ w64.t()) / temperature, -1).gather(1, case[2][:, None])[:, 0]
                row["logp_vs_fp64"] = err(a.token_logps, full)
            key = f"{str(dtype).removeprefix('torch.')}_T{temperature}"
            out[key] = row
            bad = [k for k, val in row.items() if val > (tol if k.startswith("d") else
                                                         1e-4 if dtype == torch.float32 else 2e-3)]
            worst += [f"{key}.{k}={row[k]:.1e}" for k in bad]
    out["fused_hacpo"] = fused_check()
    record("kernel", out)
    check(not worst and out["fused_hacpo"]["loss"] < 1e-4, f"Triton differs from the reference: {worst or out}")
    return (f"Triton = reference: fp32 logp {out['float32_T1.0']['logp']:.1e} (vs fp64 "
            f"{out['float32_T1.0']['logp_vs_fp64']:.1e}), bf16 logp {out['bfloat16_T1.0']['logp']:.1e}, "
            f"bf16 dW {out['bfloat16_T1.0']['dw']:.1e}; fused HACPO loss {out['fused_hacpo']['loss']:.1e}")


def fused_check() -> dict:
    import torch

    from hacrl_megatron.algo import LossInputs
    from hacrl_megatron.config import HACPOConfig
    from hacrl_megatron.kernels import fused_hacpo_loss, sequence_logprobs

    hidden, weight, targets, cu = kernel_case(1000, 256, 5003, LENS, torch.bfloat16, seed=1)
    with torch.no_grad():
        base = sequence_logprobs(hidden, weight, targets, cu, impl="reference").seq_logp_sum
    lens = (cu[1:] - cu[:-1]).float()
    inputs = LossInputs(source_logp_sum=(base / lens + torch.tensor([0.0, 0.05, 0.1, -0.02, 0.12], device="cuda"))
                        * lens, source_len=lens.long(),
                        advantages=torch.tensor([0.5, -1.0, 0.8, 1.2, -0.3], device="cuda"),
                        is_self=torch.tensor([True, False, False, True, False], device="cuda"),
                        discrepancy=torch.tensor([1.0, 2.0, 0.5, 1.0, 1.5], device="cuda"))
    res = {}
    for impl in ("triton", "reference"):
        loss, _ = fused_hacpo_loss(hidden, weight, targets, cu, inputs=inputs, update_index=1, cfg=HACPOConfig(),
                                   impl=impl)
        res[impl] = (loss, *torch.autograd.grad(loss, (hidden, weight)))
    return {"loss": err(res["triton"][0], res["reference"][0]), "dh": err(res["triton"][1], res["reference"][1]),
            "dw": err(res["triton"][2], res["reference"][2])}


TP_CASES = (("qwen3", 151936, 2), ("qwen3", 151936, 8), ("llama3", 128256, 4), ("qwen2.5", 152064, 8))


def step_tp_mask() -> str:
    """Tensor parallelism emulated on one GPU with the real vocabularies: each rank's shard statistics
    from the compiled kernel (raw off-shard ids, and ids mapped by ``core.local_target_ids``), combined
    in float64 as the all-reduces do, against the unsharded reference."""
    need_cuda()
    import torch

    from hacrl_megatron.kernels import core, sequence_logprobs
    from hacrl_megatron.kernels import triton_impl as ti
    from hacrl_megatron.kernels.vocab_parallel import VocabShard

    out, worst = {}, 0.0
    block = ti._config(torch.device("cuda"), torch.bfloat16)["BLOCK_V"]
    for model, vocab, tp in TP_CASES:
        v_local = vocab // tp
        n, h = 512, 128
        hidden, weight, targets, cu = kernel_case(n, h, vocab, [n], torch.bfloat16, seed=tp)
        tail = [r * v_local + v_local + k for r in range(tp - 1) for k in (0, 7, block - 1 - v_local % block)]
        targets[: len(tail)] = torch.tensor(tail, device="cuda")  # next-rank ids in each rank's last block
        with torch.no_grad():
            ref = sequence_logprobs(hidden, weight, targets, cu, impl="reference").token_logps.double()
            row = {"tail_targets": len(tail) if v_local % block else 0}
            for name in ("raw", "mapped"):
                stats = []
                for r in range(tp):
                    shard = VocabShard(start=r * v_local, size=v_local, world=tp, valid=v_local)
                    ids = targets - shard.start if name == "raw" else core.local_target_ids(targets, shard)
                    stats.append([t.double() for t in ti.shard_stats(hidden, weight[shard.start:shard.start + v_local],
                                                                     ids, 1.0, 0)])
                gmax = torch.stack([s[0] for s in stats]).amax(0)
                total = sum(s[1] * torch.exp(s[0] - gmax) for s in stats)
                logp = sum(s[2] for s in stats) - (gmax + torch.log(total))
                row[name] = float((logp - ref).abs().max()) if bool(torch.isfinite(logp).all()) else float("inf")
                worst = max(worst, row[name])
        out[f"{model}_tp{tp}"] = row
    record("tp_mask", out)
    check(worst < 1e-3, f"TP-emulated log-probs differ from the unsharded reference: {out}")
    return (f"{len(TP_CASES)} real-vocab TP layouts, {sum(r['tail_targets'] for r in out.values())} targets in "
            f"partly empty last blocks: finite, max |diff| {worst:.1e} vs unsharded")


def step_bench() -> str:
    """bench_logprobs.py --gpu: bare cuBLAS GEMM, naive, reference, Triton at N=16384, H=4096, V=151936 bf16."""
    need_cuda()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_logprobs.py"), "--gpu", "--repeats", "3",
                              "--json", str(path)], capture_output=True, text=True, timeout=135)
        print(res.stdout[-4000:], res.stderr[-2000:])
        check(res.returncode == 0 and path.exists(), f"bench_logprobs.py exit {res.returncode}: "
                                                     f"{(res.stderr.strip().splitlines() or ['?'])[-1]}")
        rows = {r["method"]: r for r in json.loads(path.read_text())[0]["rows"]}
    record("bench", rows)
    bare, tri = rows.get("bare", {}), rows.get("triton", {})
    check("tflops" in bare and "tflops" in tri, f"missing rows: {rows}")
    naive = rows.get("naive", {}).get("extra_mib")
    memory = f"extra memory {tri['extra_mib'] / 1024:.2f} GiB" + (
        f" vs naive {naive / 1024:.1f} GiB ({naive / max(tri['extra_mib'], 1e-9):.0f}x less)" if naive else "")
    return (f"Triton fwd+bwd {tri['seconds'] * 1e3:.0f} ms = {tri['tflops']:.0f} TFLOP/s = "
            f"{100 * tri['tflops'] / bare['tflops']:.0f}% of the bare GEMM's {bare['tflops']:.0f} TFLOP/s; "
            f"fwd {tri['fwd_seconds'] * 1e3:.0f} ms; {memory}")


# --------------------------------------------------------------------------------------------
# CUDA IPC and batch invariance

RECEIVER = """
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from hacrl_megatron.sync.cuda_ipc import device_uuid, loads_named_tensors
t0 = time.perf_counter()
named = dict(loads_named_tensors(sys.stdin.read()))
torch.cuda.synchronize()
opened = time.perf_counter() - t0
w = named["w"]
print(w.device.index, device_uuid(w.device.index), float(named["small"].float().sum()), float(w[-1, -1]), opened)
w[0, 0] = -7.0  # written through the shared memory: the sender must see it
torch.cuda.synchronize()
"""


def step_ipc() -> str:
    """Our CUDA-IPC payload (GPUs named by UUID) between two processes on one GPU: the receiver sees the
    sender's tensors without a copy and writes back into the same memory."""
    need_cuda()
    import torch

    from hacrl_megatron.sync.cuda_ipc import device_uuid, dumps_named_tensors

    w = torch.arange(256 * 2**20 // 4, dtype=torch.float32, device="cuda").view(-1, 4096)  # 256 MiB
    small = torch.arange(1000, dtype=torch.bfloat16, device="cuda")
    t0 = time.perf_counter()
    payload = dumps_named_tensors([("w", w), ("small", small)])
    dumped = time.perf_counter() - t0
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(torch.cuda.current_device())}
    res = subprocess.run([sys.executable, "-c", RECEIVER, str(ROOT)], input=payload, env=env, capture_output=True,
                         text=True, timeout=60)
    check(res.returncode == 0, f"receiver: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
    index, uuid, total, last, opened = res.stdout.split()
    torch.cuda.synchronize()
    data = {"payload_bytes": len(payload), "dump_s": dumped, "open_s": float(opened), "uuid_ok": uuid == device_uuid(0),
            "values_ok": float(total) == float(small.float().sum()) and float(last) == float(w[-1, -1]),
            "write_back_ok": float(w[0, 0]) == -7.0}
    record("ipc", data)
    check(data["uuid_ok"] and data["values_ok"] and data["write_back_ok"], f"IPC: {data}")
    return (f"256 MiB + bf16 tensor shared with a second process (payload {len(payload)} B, opened in "
            f"{float(opened) * 1e3:.0f} ms, same GPU UUID, values equal, write-back seen by the sender)")


def step_invariance() -> str:
    """Bitwise batch invariance on CUDA: each sequence alone equals itself inside the batch, at offsets
    that are not tile multiples, for both backends; a second run is identical; the on-policy ratio is 1."""
    need_cuda()
    import torch

    from hacrl_megatron.algo import LossInputs
    from hacrl_megatron.config import HACPOConfig
    from hacrl_megatron.kernels import fused_hacpo_loss, sequence_logprobs

    hidden, weight, targets, cu = kernel_case(1000, 256, 5003, LENS, torch.bfloat16)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    out = {}
    with torch.no_grad():
        for impl in ("triton", "reference"):
            full = sequence_logprobs(hidden, weight, targets, cu, impl=impl)
            same = torch.equal(full.token_logps, sequence_logprobs(hidden, weight, targets, cu, impl=impl).token_logps)
            alone = sum(torch.equal(sequence_logprobs(hidden[a:b], weight, targets[a:b], torch.tensor(
                [0, b - a], device="cuda"), impl=impl).token_logps, full.token_logps[a:b]) for a, b in bounds)
            out[impl] = {"rerun_equal": same, "alone_equal": int(alone), "sequences": len(bounds)}
        old = sequence_logprobs(hidden, weight, targets, cu, impl="triton")
    pick = [3, 1, 4]
    idx = torch.cat([torch.arange(*bounds[s], device="cuda") for s in pick])
    lens = torch.tensor([LENS[s] for s in pick], device="cuda")
    inputs = LossInputs(advantages=torch.tensor([1.0, -1.0, 0.5], device="cuda"), is_self=torch.ones(
        3, dtype=torch.bool, device="cuda"), discrepancy=torch.ones(3, device="cuda"),
        source_logp_sum=old.seq_logp_sum[pick], source_len=lens)
    _, metrics = fused_hacpo_loss(hidden[idx], weight, targets[idx], torch.cat(
        [torch.zeros(1, dtype=torch.long, device="cuda"), lens.cumsum(0)]), inputs=inputs, update_index=0,
        cfg=HACPOConfig(), impl="triton")
    out["on_policy_ratio"] = [metrics["self_ratio_min"], metrics["self_ratio_max"]]
    record("invariance", out)
    ok = all(r["rerun_equal"] and r["alone_equal"] == r["sequences"] for r in (out["triton"], out["reference"]))
    check(ok and out["on_policy_ratio"] == [1.0, 1.0], f"not batch-invariant: {out}")
    return "bitwise: every sequence alone = in the batch (Triton and reference, 5 offsets), reruns equal, ratio 1.0"


# --------------------------------------------------------------------------------------------
# the report

SECTION = "## GPU check (a lent H200)"


def section_text(results: dict, summary: list[str]) -> str:
    env = results.get("env", {})
    smi = env.get("nvidia_smi", "").split(", ")
    lines = [SECTION, "",
             f"`bash benchmarks/gpu_check.sh` on {env.get('device')} ({env.get('memory_gib')} GiB), driver "
             f"{smi[1] if len(smi) > 1 else '?'}, Python {env.get('python')}, torch {env.get('torch')} "
             f"(CUDA {env.get('cuda')}, NCCL {env.get('nccl')}), triton {env.get('triton')}, on "
             f"{time.strftime('%Y-%m-%d')}. One line per step (the numbers are in the step's JSON, "
             "`$OUT/results.json`):", "", "```", *summary, "```", ""]
    bench = results.get("bench", {})
    if "triton" in bench and "bare" in bench:
        lines += ["| method (N=16384, H=4096, V=151936, bf16) | extra memory GiB | fwd+bwd ms | TFLOP/s | "
                  "rate / bare GEMM | fwd ms |", "|---|---|---|---|---|---|"]
        for m in ("bare", "naive", "reference", "triton"):
            r = bench.get(m)
            if r and "tflops" in r:
                lines.append(f"| {m} | {r['extra_mib'] / 1024:.2f} | {r['seconds'] * 1e3:.1f} | {r['tflops']:.0f} | "
                             f"{r['tflops'] / bench['bare']['tflops']:.2f} | {r['fwd_seconds'] * 1e3:.1f} |")
        lines.append("")
    return "\n".join(lines)


def write_section(results_md: Path, text: str) -> None:
    """Replace the GPU check section of ``results_md`` (from its heading to the next ``## ``), or append it."""
    old = results_md.read_text()
    start = old.find(SECTION)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        nxt = old.find("\n## ", start + len(SECTION))
        new = old[:start] + text + ("\n" + old[nxt + 1:] if nxt >= 0 else "")
    results_md.write_text(new.rstrip("\n") + "\n")


def step_report() -> str:
    """Write the numbers into benchmarks/RESULTS.md's GPU section, and a copy of that file into $OUT."""
    need_cuda()
    results = json.loads((OUT / "results.json").read_text()) if (OUT / "results.json").exists() else {}
    summary_path = OUT / "summary.txt"
    summary = summary_path.read_text().splitlines() if summary_path.exists() else []
    target = ROOT / "benchmarks" / "RESULTS.md"
    write_section(target, section_text(results, summary))
    shutil.copyfile(target, OUT / "RESULTS.md")
    return f"wrote the '{SECTION[3:]}' section of benchmarks/RESULTS.md (copy: $OUT/RESULTS.md)"


STEPS = {"env": step_env, "wheels": step_wheels, "kernel": step_kernel, "tp_mask": step_tp_mask,
         "bench": step_bench, "megatron": step_megatron, "agent": step_agent, "ipc": step_ipc,
         "invariance": step_invariance, "report": step_report}


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.append(str(SITE))  # after site-packages: an installed package wins over a carried wheel
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as a Megatron rank on CUDA runs
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if argv[:1] == ["megatron_cpu"]:
        print(step_megatron_cpu(argv[1]))
        return 0
    if len(argv) != 1 or argv[0] not in STEPS:
        print(f"usage: gpu_check_steps.py {{{','.join(STEPS)}}}", file=sys.stderr)
        return 2
    try:
        line = STEPS[argv[0]]()
    except Skip as why:
        line = f"skipped: {why}"
    except Failed as why:
        line = f"FAILED: {why}"
    except Exception as e:  # noqa: BLE001  (one line per step whatever went wrong; the traceback is in the log)
        import traceback

        traceback.print_exc()
        line = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(f"RESULT: {' '.join(line.split())[:600]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
