#!/usr/bin/env bash
# CI step: a real two-node Slurm on this machine (tools/slurm_testbed.py) and the tests that launch
# through it (tests/slurm: the test bed, `hacrl launch --executor slurm` end to end, failure, scancel,
# requeue). Two parts, each runnable alone:
#   bash .ci/slurm.sh install   # root, Debian: apt-get the Slurm, munge and MariaDB packages (I/O bound;
#                               # can run in the background from the start of CI)
#   bash .ci/slurm.sh test      # the tests, in the active virtual environment (the README's install);
#                               # HACRL_REQUIRE_SLURM=1: a missing package fails instead of skipping
#   bash .ci/slurm.sh           # both
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)

install_slurm() {
    local t0=$SECONDS policy=""
    if [ "$(command -v slurmctld slurmd slurmdbd sbatch sacct munged mariadbd mariadb-install-db | wc -l)" -ne 8 ]; then
        # the packaged services stay stopped (the test bed starts its own daemons under a temporary folder):
        # a policy-rc.d that refuses every start, for the length of the install, unless the image has one
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            policy=/usr/sbin/policy-rc.d
            printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy"
        fi
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" \
            || { local rc=$?; [ -z "$policy" ] || rm -f "$policy"; return "$rc"; }
        [ -z "$policy" ] || rm -f "$policy"
    fi
    echo "slurm install: $((SECONDS - t0)) s"
}

test_slurm() {
    local t0=$SECONDS rc=0
    HACRL_REQUIRE_SLURM=1 python -m pytest -m slurm -q -p no:cacheprovider tests/slurm || rc=$?
    echo "slurm tests: $((SECONDS - t0)) s, exit $rc"
    # nothing of the test bed may outlive it (the fixture kills and reports leftovers; this double-checks)
    if pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || pgrep -x slurmdbd >/dev/null; then
        echo "slurm daemons still running after the tests:" >&2
        pgrep -a -x 'slurmctld|slurmd|slurmdbd|slurmstepd' >&2 || true
        rc=1
    fi
    return "$rc"
}

case "${1:-all}" in
    install) install_slurm ;;
    test) test_slurm ;;
    all) install_slurm && test_slurm ;;
    *) echo "usage: $0 [install|test|all]" >&2; exit 2 ;;
esac
