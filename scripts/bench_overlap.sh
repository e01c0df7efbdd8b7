#!/usr/bin/env bash
# Side by side on this machine's CPU threads: each point runs without and with --overlap, alternating,
# for ROUNDS rounds; prints one JSON line per run (median step after the first, warm-up, step).
# Usage: scripts/bench_overlap.sh [ROUNDS] > results.jsonl   (not part of the test suite: timings
# need a quiet machine; compare each point's fastest round of each kind).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-3}"
# shellcheck source=scripts/bench_cpu.sh
source scripts/bench_cpu.sh
sizes() { local heads=$(( $1 / 64 > 4 ? $1 / 64 : 4 )); echo "--set layers=2 --set hidden=$1 --set heads=$heads --set seq=$2 --set batch=8 --set vocab=2048 --set context=$2"; }
median_step() {
    python3 -c "
import sys, json, statistics
e = [json.loads(l)['elapsed_s'] for l in sys.stdin if 'elapsed_s' in l]
print(statistics.median([b - a for a, b in zip(e, e[1:])]))"
}
for point in "2x2 optimus 256 128" "4x4 optimus 128 64" "1x2 megatron 768 256" "2x2x2 optimus 256 128" "2x2 optimus 768 256"; do
    read -r mesh strategy hidden seq <<<"$point"
    for round in $(seq "$ROUNDS"); do
        for overlap in false true; do
            flag=""; [ "$overlap" = true ] && flag="--overlap"
            # shellcheck disable=SC2046
            step=$($R run examples/gpt2.opt --mesh "$mesh" --strategy "$strategy" $(sizes "$hidden" "$seq") \
                --steps 6 --json $flag 2>/dev/null | median_step)
            printf '{"mesh":"%s","strategy":"%s","hidden":%s,"seq":%s,"layers":2,"batch":8,"vocab":2048,"overlap":%s,"round":%s,"step_s":%s,"cpu":"%s","threads":%s,"date":"%s"}\n' \
                "$mesh" "$strategy" "$hidden" "$seq" "$overlap" "$round" "$step" "$CPU" "$(nproc)" "$(date -u +%F)"
        done
    done
done
