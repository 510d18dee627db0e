#!/usr/bin/env bash
# Plan and submit the two-70B-agent preset (Llama-3.1-70B-Instruct + Qwen2.5-72B-Instruct) to a
# Slurm cluster with NeMo-Run, in the hacrl-megatron container (README.md of this folder).
#
#   ACCOUNT=my_account PARTITION=batch bash examples/multi_node_70b/launch.sh [hacrl launch flags]
#
# Environment (defaults in brackets): ACCOUNT (required), PARTITION [batch], NODES [9],
# GPUS_PER_NODE [8], GPU_MEMORY_GIB [74.5: an 80 GB H100], TIME [48:00:00], JOB_DIR
# [/shared/hacrl/jobs], MODELS [/shared/hacrl/models], DATA [/shared/hacrl/data], RUNS
# [/shared/hacrl/runs], SOCKET_IFNAME [unset: NCCL's own choice; e.g. ib0]. Extra arguments go to
# `hacrl launch` (e.g. --dryrun --base-dir DIR, --container-image /shared/images/hacrl.sqsh).
set -euo pipefail
: "${ACCOUNT:?set ACCOUNT to your Slurm account}"
PARTITION="${PARTITION:-batch}" NODES="${NODES:-9}" GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
GPU_MEMORY_GIB="${GPU_MEMORY_GIB:-74.5}" TIME="${TIME:-48:00:00}" JOB_DIR="${JOB_DIR:-/shared/hacrl/jobs}"
MODELS="${MODELS:-/shared/hacrl/models}" DATA="${DATA:-/shared/hacrl/data}" RUNS="${RUNS:-/shared/hacrl/runs}"
PRESET=multinode_llama70b_qwen72b
L=/models/Llama-3.1-70B-Instruct Q=/models/Qwen2.5-72B-Instruct
paths=(output_dir="/runs/$PRESET" data.path=/data/math/train.jsonl agents.0.model.hf_path="$L"
       agents.0.tokenizer="$L" agents.1.model.hf_path="$Q" agents.1.tokenizer="$Q")

# 1. the layout for this cluster, as overrides (exit status 2 with one line when nothing fits)
mapfile -t layout < <(hacrl plan --preset "$PRESET" "${paths[@]}" --nodes "$NODES" \
    --gpus-per-node "$GPUS_PER_NODE" --gpu-memory-gib "$GPU_MEMORY_GIB" --json |
    python -c 'import json, sys; print("\n".join(json.load(sys.stdin)["overrides"]))')
# 2. one Slurm job: node 0 runs the controller; the trainers' Ray worker groups and the SGLang
#    engines go where the plan put them (the Ray script's "# placement:" lines say which)
ifname=(${SOCKET_IFNAME:+--socket-ifname "$SOCKET_IFNAME"})
hacrl launch "$@" "${ifname[@]}" --executor slurm --account "$ACCOUNT" --partition "$PARTITION" --nodes "$NODES" \
    --gpus-per-node "$GPUS_PER_NODE" --time "$TIME" --job-dir "$JOB_DIR" --name "$PRESET" \
    --mount "$MODELS:/models" --mount "$DATA:/data" --mount "$RUNS:/runs" \
    --env HACRL_DATA_DIR=/data --env HF_HUB_OFFLINE=1 --detach \
    --preset "$PRESET" "${paths[@]}" "${layout[@]}"
