#!/usr/bin/env bash
# The real SGLang server on CPU for CI (the recipe of tests/fixtures/sglang_cpu/, docs/engines.md).
#   .ci/sglang.sh install   build the server venv (default .venv-ci-sglang): CPU torch, the pinned subset of
#                           SGLang's requirements, sglang==0.5.23 --no-deps, the sgl_kernel/torchvision shims
#   .ci/sglang.sh test      the real-server conformance suite and the `hacrl train` end-to-end runs, with
#                           HACRL_REQUIRE_SGLANG=1 (a missing server fails them); run inside the package's venv
# Each prints its own elapsed seconds. SGLANG_VENV overrides the venv folder.
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VENV="${SGLANG_VENV:-.venv-ci-sglang}"
RECIPE=tests/fixtures/sglang_cpu

install() {
    local t0=$SECONDS
    python3 -m venv "$SGLANG_VENV"
    local py="$SGLANG_VENV/bin/python"
    "$py" -m pip install -q --upgrade pip
    "$py" -m pip install -q torch==2.13.0  # the CPU wheel first; constraints.txt keeps it through the rest
    "$py" -m pip install -q -c "$RECIPE/constraints.txt" -r "${SGLANG_REQUIREMENTS:-$RECIPE/requirements.txt}"
    "$py" -m pip install -q --no-deps sglang==0.5.23
    # SGLang's CPU kernels are published neither as wheel nor sdist, and PyPI's torchvision is a CUDA build:
    # our torch-only sgl_kernel and an import-only torchvision go into the venv's site-packages
    local site
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    rm -rf "$site/sgl_kernel" "$site/torchvision"
    cp -r "$RECIPE/shims/sgl_kernel" "$RECIPE/shims/torchvision" "$site/"
    find "$site/sgl_kernel" "$site/torchvision" -name __pycache__ -prune -exec rm -rf {} +
    SGLANG_USE_CPU_ENGINE=1 "$py" -c "import sglang, sgl_kernel, torch; print('sglang', sglang.__version__, \
'torch', torch.__version__)"
    echo "sglang CPU server install: $((SECONDS - t0)) s"
}

test_real_server() {
    local t0=$SECONDS
    # one server at a time: the conformance module's server stops before the end-to-end runs start theirs.
    # The end-to-end run with `disk` sync is left to a run by hand (`pytest -m sglang tests/e2e/test_rollout_sglang.py`):
    # the conformance suite already pushes disk updates to this real server and checks log-probs after them,
    # and the run would add ~5 minutes to CI; `distributed`, the default `auto` resolves to, runs here.
    HACRL_REQUIRE_SGLANG=1 HACRL_SGLANG_PYTHON="$PWD/$SGLANG_VENV/bin/python" \
        python -m pytest -m sglang -q -s -p no:cacheprovider tests/conformance tests/e2e/test_rollout_sglang.py \
        -k "not (runs_three_steps and disk)"
    echo "SGLang real-server tests: $((SECONDS - t0)) s"
}

case "${1:-}" in
    install) install ;;
    test) test_real_server ;;
    *) echo "usage: .ci/sglang.sh install|test" >&2; exit 2 ;;
esac
