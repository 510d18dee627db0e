#!/usr/bin/env bash
# The GPU check for the machine we are lent: one H200 for 15 minutes in all (its start included), no
# network, Python 3.12 with torch + triton preinstalled, no megatron-core / Transformer Engine / Ray /
# SGLang / vLLM, at most 64 MiB of files carried over from the repository, at most 8 result files.
#
#   bash benchmarks/gpu_check.sh          # from the repository root; results under ${OUT:-gpu_check_out}/
#
# Every step is a bounded call of benchmarks/gpu_check_steps.py and prints one line (a result,
# "skipped: <why>" or "FAILED: <what>") even when an earlier step failed; the step limits plus their
# kill grace add up to BUDGET_S below (< 9 minutes), so a second run still fits the 15 minutes. Nothing
# is installed and nothing is downloaded: the repository is imported from this folder, and carried
# wheels are unpacked (not pip-installed) into $GPU_CHECK_SITE.
#
# What a lent H200 answers (one line each):
#   env        Python, torch, triton, CUDA, NCCL, device, which packages import, which wheels came along
#   wheels     the carried wheels unpacked for the packages that do not import here
#   kernel     the compiled Triton log-prob kernel vs the torch reference (fp32, bf16, T = 1 and 0.7;
#              values and gradients; fp32 also vs float64 full logits) and the fused HACPO loss
#   tp_mask    the TP fix: tensor parallelism emulated on one GPU with Qwen3 / Llama-3 / Qwen2.5 vocabularies
#              at TP 2/4/8, next-rank targets in each rank's partly empty last block, vs unsharded
#   bench      Triton vs the reference, naive logits and a bare cuBLAS GEMM at N=16384, H=4096,
#              V=151936, bf16: ms, TFLOP/s, % of the GEMM's rate, extra memory (bench_logprobs.py --gpu)
#   megatron   megatron-core's GPTModel (local spec) forward + backward on CUDA vs the same weights on CPU
#   agent      one LocalAgent HACPO update on CUDA through the fused Triton loss vs megatron's CE, and with
#              overlapped DDP (overlap_grad_reduce, overlap_param_gather, 1 MiB buckets) vs without; the
#              device memory free where colocated engines resume, with and without trainer offload
#              (rollout.colocate_offload none / optimizer / all), and the wake bit-identical
#   ipc        our CUDA-IPC tensor payload between two processes on the GPU (zero copy, write-back)
#   invariance bitwise batch invariance on CUDA (Triton and reference), on-policy ratio exactly 1
#   report     the numbers into benchmarks/RESULTS.md's GPU section (+ a copy in $OUT to bring back)
# What still needs a full cluster: Transformer Engine layers and TP/PP/EP > 1 over NCCL (several
# GPUs), Ray agents and engines across nodes, real SGLang and vLLM servers with each weight
# transport (their venvs, NCCL between trainer and engine GPUs), multi-node Slurm launches, and the
# paper-scale runs (tools/image/gpu_site_check.sh, in the image on a GPU node, covers TE, a Ray agent
# on NCCL and the engine venvs' NCCL on one node).
#
# megatron-core (and any of numpy, packaging, pyyaml the lent Python lacks): download the Python 3.12
# wheels on a machine with network into .whl/ (ignored by git), then carry that folder:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       -d .whl "megatron-core==0.19.2"        # 2.4 MB; add numpy packaging pyyaml if needed (~20 MB)
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"])     # the device tool of a session
# Without the wheel the megatron and agent steps print "skipped: megatron.core does not import (...)".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
export OUT
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || PY=python
export GPU_CHECK_SITE="${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/hacrl_gpu_site}"
export PYTHONPATH="$PWD:$GPU_CHECK_SITE${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
LOG="$OUT/gpu_check.log"        # everything the steps print (tracebacks included)
SUMMARY="$OUT/summary.txt"      # one line per step; results.json holds the numbers; RESULTS.md the report
KILL_AFTER=2                    # seconds a timed-out step gets between SIGTERM and SIGKILL
# name:limit_s, in order (the report reads the summary of the steps before it)
STEPS=(env:30 wheels:10 kernel:70 tp_mask:40 bench:145 megatron:60 agent:80 ipc:30 invariance:35 report:10)
BUDGET_S=0
for entry in "${STEPS[@]}"; do BUDGET_S=$((BUDGET_S + ${entry#*:} + KILL_AFTER)); done
: > "$LOG"
: > "$SUMMARY"
echo "gpu_check: ${#STEPS[@]} steps, at most ${BUDGET_S} s; results in $OUT/" | tee -a "$LOG"
start=$SECONDS
for entry in "${STEPS[@]}"; do
    name="${entry%%:*}"
    limit="${entry#*:}"
    t0=$SECONDS
    echo "== $name (limit ${limit} s)" >> "$LOG"
    step_out="$(timeout -k "$KILL_AFTER" "$limit" "$PY" benchmarks/gpu_check_steps.py "$name" 2>&1)"
    rc=$?
    printf '%s\n' "$step_out" >> "$LOG"
    line="$(printf '%s\n' "$step_out" | sed -n 's/^RESULT: //p' | tail -n 1)"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        line="FAILED: timed out after ${limit} s"
    elif [ -z "$line" ]; then
        line="FAILED: exit $rc, $(printf '%s\n' "$step_out" | grep -v '^\s*$' | tail -n 1 | cut -c1-300)"
    fi
    printf '%-10s %s (%d s)\n' "$name" "$line" $((SECONDS - t0)) | tee -a "$SUMMARY"
done
echo "gpu_check: done in $((SECONDS - start)) s (bound ${BUDGET_S} s)" | tee -a "$LOG"
