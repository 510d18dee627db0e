#!/usr/bin/env bash
# The rollout exchange's redis backend against a real redis-server (docs/exchange.md). CI runs these tests in
# the README's test command (step 1 of .ci/run, with HACRL_REQUIRE_REDIS=1); this script runs them alone.
# Two parts, each runnable alone:
#   bash .ci/redis.sh install   # root, Debian: apt-get redis-server (the test fixture starts its own server
#                               # on 127.0.0.1 with a password; the packaged service stays stopped), openssl
#                               # for the TLS test, and the `exchange` extra (redis-py) into the active venv
#   bash .ci/redis.sh test      # the exchange tests in the active venv with HACRL_REQUIRE_REDIS=1: a missing
#                               # server, client package or openssl fails them instead of skipping
#   bash .ci/redis.sh           # both
set -euo pipefail
cd "$(dirname "$0")/.."

install_redis() {
    local t0=$SECONDS policy=""
    if ! command -v redis-server >/dev/null || ! command -v openssl >/dev/null; then
        # a policy-rc.d that refuses every service start for the length of the install, unless the image has one
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            policy=/usr/sbin/policy-rc.d
            printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy"
        fi
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server openssl \
            || { local rc=$?; [ -z "$policy" ] || rm -f "$policy"; return "$rc"; }
        [ -z "$policy" ] || rm -f "$policy"
    fi
    python -m pip install -q "redis>=5.0,<9"  # the `exchange` extra of setup.py
    echo "redis install: $((SECONDS - t0)) s"
}

test_redis() {
    local t0=$SECONDS rc=0
    HACRL_REQUIRE_REDIS=1 python -m pytest -q -p no:cacheprovider \
        tests/unit/test_peer_exchange_stores.py tests/unit/test_peer_exchange_redis.py tests/e2e/test_agent_jobs.py \
        || rc=$?
    echo "redis exchange tests: $((SECONDS - t0)) s, exit $rc"
    return "$rc"
}

case "${1:-all}" in
    install) install_redis ;;
    test) test_redis ;;
    all) install_redis && test_redis ;;
    *) echo "usage: $0 [install|test|all]" >&2; exit 2 ;;
esac
