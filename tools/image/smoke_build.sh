#!/usr/bin/env bash
# Build the top-level Dockerfile on a CPU machine without a Docker engine, then run the CPU demo in it.
#
#   tools/image/smoke_build.sh            # as root; needs: apt-get install buildah mmdebstrap
#
# 1. base: a Debian bookworm root filesystem (mmdebstrap: python3, venv, pip, CA certificates) with
#    the CPU torch 2.13.0 wheel of this machine's pip find-links folder installed (cp311 = Debian's
#    Python 3.11) plus triton, numpy and packaging (NGC ships them; megatron-core 0.19 imports
#    triton, and its --ignore-requires-python install would otherwise pick a Python-3.12-only numpy
#    sdist), committed as $BASE_TAG. It stands
#    in for the NGC PyTorch base (no CUDA, no Transformer Engine).
# 2. image: `buildah bud` of the SAME Dockerfile with BASE_IMAGE=$BASE_TAG (storage driver vfs,
#    chroot isolation: no daemon, no user namespaces). Build args that differ from a GPU build:
#    MCORE_PIP_FLAGS=--ignore-requires-python (megatron-core 0.19.x declares Python >= 3.12) and
#    SGLANG_REQUIREMENT=$SGLANG_STANDIN (a small package instead of SGLang, whose torch pin would pull
#    a multi-GB CUDA torch: the venv mechanics are exercised, SGLang itself is not).
# 3. checks inside the image, through its entrypoint: `hacrl --help`, `hacrl train --preset cpu_demo`
#    for a few steps, the torch build still the base's, the SGLang venv's interpreter, the NCCL
#    alignment check (nccl_align.py --check; nothing to align without CUDA).
# Mounted read-only into every build step: the host CA bundle (pip behind this network's TLS proxy),
# and this machine's local pip sources (find-links folder with the torch wheel, file:// indexes)
# with a pip.conf naming them, so pip resolves as it does on the host: torch never from PyPI.
# Prints the build times and the image size. Environment: HACRL_SMOKE_WORK (scratch folder),
# HACRL_SMOKE_KEEP=1 (keep images and the work folder), HACRL_SMOKE_REUSE_BASE=1 (reuse a kept base
# image: iterating on the Dockerfile), HACRL_CA_FILE, HACRL_TORCH_WHEEL.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="${HACRL_SMOKE_WORK:-/tmp/hacrl-image-smoke}"
BASE_TAG="localhost/hacrl-cpu-base:bookworm"
IMAGE_TAG="localhost/hacrl-megatron:cpu-smoke"
CA_FILE="${HACRL_CA_FILE:-/etc/ssl/certs/ca-certificates.crt}"
SGLANG_STANDIN="${HACRL_SGLANG_STANDIN:-six==1.17.0}"
TORCH_VERSION="2.13.0"
BUILDAH=(buildah --storage-driver vfs)

die() { echo "smoke_build: $*" >&2; exit 2; }
now() { date +%s; }

for tool in buildah mmdebstrap python3; do
    command -v "$tool" >/dev/null || die "$tool not found (apt-get install -y buildah mmdebstrap)"
done
[ "$(id -u)" -eq 0 ] || die "run as root (buildah with chroot isolation and mmdebstrap need it)"
[ -r "$CA_FILE" ] || die "CA bundle $CA_FILE not readable (set HACRL_CA_FILE)"

# The local CPU torch wheel: where `pip install torch==2.13.0` finds it on this machine.
find_torch_wheel() {
    if [ -n "${HACRL_TORCH_WHEEL:-}" ]; then echo "$HACRL_TORCH_WHEEL"; return; fi
    local dirs dir
    dirs="${PIP_FIND_LINKS:-} $(python3 -m pip config list 2>/dev/null | sed -n "s/^.*find-links='\(.*\)'$/\1/p")"
    for dir in $dirs; do
        dir="${dir#file://}"
        for whl in "$dir"/torch-"$TORCH_VERSION"*-cp311-cp311-*linux*x86_64.whl; do
            [ -f "$whl" ] && { echo "$whl"; return; }
        done
    done
}
WHEEL="$(find_torch_wheel)"
[ -n "$WHEEL" ] || die "no torch-$TORCH_VERSION cp311 wheel in the pip find-links folders (PIP_FIND_LINKS, \
pip config) - set HACRL_TORCH_WHEEL"
WHEEL_DIR="$(cd "$(dirname "$WHEEL")" && pwd)"

rm -rf "$WORK"
mkdir -p "$WORK"
MOUNTS=(-v "$CA_FILE:$CA_FILE:ro" -v "$WHEEL_DIR:/wheels:ro" -v "$WORK/pip.conf:/etc/pip.conf:ro")
# this machine's file:// package indexes (pip config extra-index-url), mounted at the same paths
INDEXES=""
for url in $(python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*extra-index-url='\(.*\)'$/\1/p"); do
    case "$url" in
        file://*) dir="${url#file://}"; top="${dir%/simple}"; top="${top%/}"
                  if [ -d "$dir" ]; then MOUNTS+=(-v "$top:$top:ro"); INDEXES="$INDEXES $url"; fi ;;
    esac
done
printf '[global]\nfind-links = /wheels\ncert = %s\n' "$CA_FILE" > "$WORK/pip.conf"
[ -z "$INDEXES" ] || printf 'extra-index-url =%s\n' "$INDEXES" >> "$WORK/pip.conf"

CTRS=()  # working containers this script made (removed at exit; never anyone else's)
cleanup() {
    if [ "${#CTRS[@]}" -gt 0 ]; then
        "${BUILDAH[@]}" rm "${CTRS[@]}" >/dev/null 2>&1 || true
    fi
    if [ "${HACRL_SMOKE_KEEP:-0}" != 1 ]; then
        "${BUILDAH[@]}" rmi -f "$IMAGE_TAG" "$BASE_TAG" >/dev/null 2>&1 || true
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

build_base() {
    mmdebstrap --quiet --variant=minbase \
        --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates,passwd \
        bookworm "$WORK/rootfs.tar"
    t_rootfs=$(( $(now) - t0 ))
    ctr=$("${BUILDAH[@]}" from scratch)
    CTRS+=("$ctr")
    "${BUILDAH[@]}" add --quiet "$ctr" "$WORK/rootfs.tar" /
    "${BUILDAH[@]}" run --isolation chroot "${MOUNTS[@]}" "$ctr" -- python3 -m pip install --quiet \
        --break-system-packages --no-cache-dir --root-user-action=ignore "/wheels/$(basename "$WHEEL")" triton \
        numpy "packaging>=24.2"
    "${BUILDAH[@]}" config --env PIP_BREAK_SYSTEM_PACKAGES=1 --env LANG=C.UTF-8 --cmd /bin/bash "$ctr"
    "${BUILDAH[@]}" commit --quiet "$ctr" "$BASE_TAG" >/dev/null
    "${BUILDAH[@]}" rm "$ctr" >/dev/null
    CTRS=()
    rm -f "$WORK/rootfs.tar"
}

echo "== 1. CPU base image $BASE_TAG (mmdebstrap bookworm + $(basename "$WHEEL")) =="
t0=$(now)
t_rootfs=0
if [ "${HACRL_SMOKE_REUSE_BASE:-0}" = 1 ] && "${BUILDAH[@]}" inspect --type image "$BASE_TAG" >/dev/null 2>&1; then
    echo "reusing $BASE_TAG"
else
    build_base
fi
t_base=$(( $(now) - t0 ))

echo "== 2. image $IMAGE_TAG from $ROOT/Dockerfile =="
t0=$(now)
"${BUILDAH[@]}" bud --isolation chroot --format docker --pull=never "${MOUNTS[@]}" \
    --build-arg BASE_IMAGE="$BASE_TAG" \
    --build-arg MCORE_PIP_FLAGS=--ignore-requires-python \
    --build-arg SGLANG_REQUIREMENT="$SGLANG_STANDIN" \
    -t "$IMAGE_TAG" -f "$ROOT/Dockerfile" "$ROOT"
t_image=$(( $(now) - t0 ))

echo "== 3. run inside the image =="
t0=$(now)
ctr=$("${BUILDAH[@]}" from "$IMAGE_TAG")
CTRS+=("$ctr")
run() { "${BUILDAH[@]}" run --isolation chroot "$ctr" -- /usr/local/bin/hacrl-entrypoint "$@"; }
run hacrl --help
run python -c "import torch, megatron.core; assert torch.__version__ == '$TORCH_VERSION+cpu', torch.__version__; \
print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
run python -m pytest -q -p no:cacheprovider tests/unit/test_config.py
run sh -c 'test "$(id -u)" != 0 && test -x "$HACRL_SGLANG_PYTHON" && "$HACRL_SGLANG_PYTHON" -c "import six, sys; \
assert sys.prefix == \"/opt/sglang\", sys.prefix; print(\"sglang venv\", sys.prefix, \"user\", __import__(\"os\").getuid())"'
# one NCCL for trainer and engine venvs: on this CPU base there is none, so the check says so and passes
run python3 /usr/local/lib/hacrl/nccl_align.py --check "/opt/sglang/bin/python"
run hacrl train --preset cpu_demo train.steps=2 train.sft_warmup=false train.prompts_per_step=4 \
    train.eval_every=0 data.eval_size=8 checkpoint.every=0 log.progress=false output_dir=/tmp/smoke_run
run test -s /tmp/smoke_run/metrics.jsonl
t_run=$(( $(now) - t0 ))

size=$("${BUILDAH[@]}" images --noheading --format '{{.Size}}' "$IMAGE_TAG")
base_size=$("${BUILDAH[@]}" images --noheading --format '{{.Size}}' "$BASE_TAG")
echo "smoke_build: rootfs ${t_rootfs}s, base ${t_base}s (${base_size}), image build ${t_image}s ($size)," \
     "runs in the image ${t_run}s"
echo "smoke_build: OK"
