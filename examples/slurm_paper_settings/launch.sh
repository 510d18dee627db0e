#!/usr/bin/env bash
# Submit the paper's three HACRL settings (Table 5) to a Slurm cluster with NeMo-Run, one job each,
# in the hacrl-megatron container (pyxis/enroot): every job starts a Ray cluster over its nodes and
# runs `python -m hacrl_megatron train --preset <setting>` on it (README.md of this folder).
#
#   ACCOUNT=my_account PARTITION=batch bash examples/slurm_paper_settings/launch.sh [hacrl launch flags]
#
# Environment (defaults in brackets): ACCOUNT (required), PARTITION [batch], NODES [1],
# GPUS_PER_NODE [8], TIME [24:00:00], JOB_DIR [/shared/hacrl/jobs: job files on the shared
# filesystem], MODELS [/shared/hacrl/models: one HF folder per model, named as on the hub],
# DATA [/shared/hacrl/data: <name>/<split>.jsonl per dataset, as `hacrl prepare data` writes],
# RUNS [/shared/hacrl/runs: metrics, checkpoints, final agents], SETTINGS [all three presets].
# Extra arguments go to every `hacrl launch` (e.g. --dryrun --base-dir DIR, --ssh-host/--ssh-user,
# --container-image IMG; default image: $HACRL_IMAGE or hacrl-megatron:<version>).
set -euo pipefail
: "${ACCOUNT:?set ACCOUNT to your Slurm account}"
PARTITION="${PARTITION:-batch}" NODES="${NODES:-1}" GPUS_PER_NODE="${GPUS_PER_NODE:-8}" TIME="${TIME:-24:00:00}"
JOB_DIR="${JOB_DIR:-/shared/hacrl/jobs}" MODELS="${MODELS:-/shared/hacrl/models}"
DATA="${DATA:-/shared/hacrl/data}" RUNS="${RUNS:-/shared/hacrl/runs}"
SETTINGS="${SETTINGS:-paper_qwen3_4b_with_instruct paper_qwen3_1p7b_with_4b_base paper_qwen3_4b_base_with_llama3p2_3b}"

# the two models of each setting, as folder names under $MODELS (agents 0 and 1 of the preset)
declare -A MODEL0=([paper_qwen3_4b_with_instruct]=Qwen3-4B [paper_qwen3_1p7b_with_4b_base]=Qwen3-1.7B-Base
                   [paper_qwen3_4b_base_with_llama3p2_3b]=Qwen3-4B-Base)
declare -A MODEL1=([paper_qwen3_4b_with_instruct]=Qwen3-4B-Instruct-2507 [paper_qwen3_1p7b_with_4b_base]=Qwen3-4B-Base
                   [paper_qwen3_4b_base_with_llama3p2_3b]=Llama-3.2-3B-Instruct)

for preset in $SETTINGS; do
    m0="/models/${MODEL0[$preset]:?unknown setting $preset}" m1="/models/${MODEL1[$preset]}"
    # The job runs in the shipped checkout (/nemo_run/code); the presets' relative models/ and data/
    # paths are pointed at the mounted folders. --no-validate: those paths exist on the cluster only.
    hacrl launch "$@" --executor slurm --account "$ACCOUNT" --partition "$PARTITION" --nodes "$NODES" \
        --gpus-per-node "$GPUS_PER_NODE" --time "$TIME" --job-dir "$JOB_DIR" --name "$preset" \
        --mount "$MODELS:/models" --mount "$DATA:/data" --mount "$RUNS:/runs" \
        --env HACRL_DATA_DIR=/data --env HF_HUB_OFFLINE=1 --no-validate --detach \
        --preset "$preset" output_dir="/runs/$preset" data.path=/data/math/train.jsonl \
        agents.0.model.hf_path="$m0" agents.0.tokenizer="$m0" agents.1.model.hf_path="$m1" agents.1.tokenizer="$m1"
done
