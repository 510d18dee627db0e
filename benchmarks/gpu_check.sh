#!/usr/bin/env bash
# One short device check for a session that is lent a GPU (~6 minutes): correctness of every
# GPU-only path first, then the kernel benchmark. Writes everything under ${OUT:-gpu_check_out}/;
# copy the numbers into benchmarks/RESULTS.md afterwards.
#   bash benchmarks/gpu_check.sh            (on the device machine, from the repository root)
set -uo pipefail
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python -m pip install -q -e ".[cpu,dev]" > "$out/install.log" 2>&1 || echo "install failed (see install.log)"
python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    | tee "$out/versions.txt"
# 1. correctness: Triton vs reference (bf16/fp32, arbitrary offsets), TE layer spec, Ray on GPU
timeout 240 python -m pytest tests/gpu tests/unit/test_models_convert.py tests/distributed/test_ray_agent.py \
    -q -p no:cacheprovider -m "not slow" 2>&1 | tail -40 > "$out/pytest_gpu.txt"
tail -3 "$out/pytest_gpu.txt"
# 2. speed and memory: bare GEMM vs naive vs reference vs Triton at N=16384, H=4096, V=151936 (bf16)
timeout 240 python benchmarks/bench_logprobs.py --gpu 2>&1 | tee "$out/bench_logprobs_gpu.txt" | tail -15
