#!/usr/bin/env bash
# First run of the default demo as a new user sees it: `hacrl train` with an EMPTY cache
# (HACRL_CACHE=<fresh temp dir>), so any warm-up the package does not ship is trained from scratch.
# Prints the wall time, the CPU time (user + sys of hacrl and its children: close to the wall time an
# idle machine would take, since the demo runs one thread), peak RSS and the load average before and
# after (the CPU machines are shared: a wall time without its load is not comparable).
#   bash benchmarks/bench_first_run.sh                 # the cpu_demo preset, 60 HACPO steps
#   bash benchmarks/bench_first_run.sh train.steps=10  # extra overrides go to `hacrl train`
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d /tmp/hacrl_first_run.XXXXXX)"
trap 'rm -rf "$work"' EXIT
export HACRL_CACHE="$work/cache" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)  (cores: $(nproc))"
start=$(date +%s.%N)
/usr/bin/time -f "%M %U %S" -o "$work/usage" hacrl train output_dir="$work/run" log.progress=false "$@" \
    > "$work/stdout" 2> "$work/stderr" || { tail -30 "$work/stderr"; exit 1; }
end=$(date +%s.%N)
echo "load average after:  $(cut -d' ' -f1-3 /proc/loadavg)"
grep -E "warm-up .*(done|shipped)" "$work/stderr" || true
tail -5 "$work/stdout"
read -r rss user sys < <(tail -1 "$work/usage")
awk -v s="$start" -v e="$end" -v rss="$rss" -v user="$user" -v sys="$sys" \
    'BEGIN { t = e - s; cpu = user + sys; printf "first run: %.0f s (%d min %02d s) wall, %.0f s CPU (user+sys), peak RSS %.2f GB\n",
             t, t / 60, t % 60, cpu, rss / 1048576 }'
