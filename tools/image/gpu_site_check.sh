#!/usr/bin/env bash
# What the CPU smoke build (tools/image/smoke_build.sh) cannot check: run inside the real image on a
# GPU node, from the image's working directory (docs/clusters.md, docs/status.md):
#
#   docker run --rm --gpus all --ipc=host hacrl-megatron:0.1.0 bash tools/image/gpu_site_check.sh
#
# 1. the NGC stack is the base's own (torch, triton, NVIDIA and Transformer Engine versions equal the
#    pins in /etc/hacrl/constraints.txt), CUDA is visible, Transformer Engine and megatron-core import;
# 2. the SGLang venv imports sglang with its own CUDA torch, and every engine venv loads the
#    trainer's NCCL (tools/image/nccl_align.py --check);
# 3. the GPU tests: Triton kernel vs reference, the Transformer Engine layer spec, Ray agents on NCCL.
# Exit status 0 only when every check passes.
set -euo pipefail

echo "== 1. NGC stack =="
nvidia-smi -L
python - <<'EOF'
import importlib.metadata as md
import re

import megatron.core
import torch
import transformer_engine

pins = {}
for line in open("/etc/hacrl/constraints.txt"):
    m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
    if m:
        pins[m.group(1).lower().replace("_", "-")] = m.group(2)
changed = {}
for name, want in pins.items():
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        continue
    if have != want:
        changed[name] = (want, have)
assert not changed, f"base packages replaced by the build (pinned, installed): {changed}"
assert torch.cuda.is_available(), "CUDA not visible (docker run --gpus all?)"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(),
      "| transformer_engine", transformer_engine.__version__, "| megatron-core", megatron.core.__version__,
      f"| {len(pins)} base pins kept")
EOF

echo "== 2. SGLang venv (${HACRL_SGLANG_PYTHON:?image sets HACRL_SGLANG_PYTHON}) =="
"$HACRL_SGLANG_PYTHON" -c "import sglang, torch; assert torch.cuda.is_available(); \
print('sglang', sglang.__version__, 'torch', torch.__version__)"

echo "== 2b. one NCCL for the trainer and every engine venv (the weight-update group needs it) =="
python3 /usr/local/lib/hacrl/nccl_align.py --check "$HACRL_SGLANG_PYTHON" "${HACRL_VLLM_PYTHON:-/opt/vllm/bin/python}"

echo "== 3. GPU tests =="
python -m pytest -q -p no:cacheprovider -m "not slow" tests/gpu tests/unit/test_models_convert.py \
    tests/distributed/test_ray_agent.py
echo "gpu_site_check: OK"
