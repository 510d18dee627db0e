#!/bin/sh
# Entrypoint of the hacrl-megatron image (see Dockerfile, docs/clusters.md).
#   docker run IMAGE hacrl train --preset cpu_demo      -> runs that command
#   docker run IMAGE python -m pytest -q tests/unit     -> runs that command
#   docker run IMAGE train --preset cpu_demo            -> `hacrl train ...` (not a program: a hacrl sub-command)
#   docker run IMAGE --help                             -> `hacrl --help`
# On an NGC base, the command goes through NVIDIA's entrypoint (driver and CUDA compatibility checks).
set -e
if [ "$#" -eq 0 ]; then
    set -- hacrl --help
fi
case "$1" in
    -*) set -- hacrl "$@" ;;
    *) command -v "$1" >/dev/null 2>&1 || set -- hacrl "$@" ;;
esac
if [ -x /opt/nvidia/nvidia_entrypoint.sh ]; then
    exec /opt/nvidia/nvidia_entrypoint.sh "$@"
fi
exec "$@"
