#!/usr/bin/env bash
# Device threads that hand their kernels to the pool against device threads that run them themselves
# (OPTIMUS_DEVICE_KERNELS=pool|inline), alternating, for ROUNDS rounds; one JSON line per run with the
# median step after the first. Usage: scripts/bench_device_kernels.sh [ROUNDS] > results.jsonl
# (not part of the test suite: timings need a quiet machine; compare each point's fastest round).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-2}"
# shellcheck source=scripts/bench_cpu.sh
source scripts/bench_cpu.sh
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
median_step() {
    python3 - "$LOG" <<'PY'
import json, statistics, sys
records = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
elapsed = [r["elapsed_s"] for r in records if "elapsed_s" in r]
print(statistics.median([b - a for a, b in zip(elapsed, elapsed[1:])]))
PY
}
# Points: mesh, strategy, layers/hidden/heads/vocab/seq/batch, GPT-2 shaped.
for point in "1x1 optimus 2 64 4 1024 64 8" "2x2 optimus 2 64 4 1024 64 8" "4x4 optimus 2 64 4 1024 64 8" \
    "1x4 megatron 2 64 4 1024 64 8" "1x1 optimus 4 128 4 4096 128 8" "2x2 optimus 4 128 4 4096 128 8" \
    "1x2 megatron 4 128 4 4096 128 8" "1x1 optimus 4 256 8 8192 128 8" "2x2 optimus 4 256 8 8192 128 8" \
    "1x2 megatron 4 256 8 8192 128 8"; do
    read -r mesh strategy layers hidden heads vocab seq batch <<<"$point"
    sets="--set layers=$layers --set hidden=$hidden --set heads=$heads --set vocab=$vocab --set seq=$seq --set batch=$batch"
    for round in $(seq "$ROUNDS"); do
        for mode in pool inline; do
            # shellcheck disable=SC2086
            OPTIMUS_DEVICE_KERNELS=$mode $R run examples/gpt2.opt --mesh "$mesh" --strategy "$strategy" $sets --steps 8 --json >"$LOG" 2>&1
            printf '{"mesh":"%s","strategy":"%s","layers":%s,"hidden":%s,"heads":%s,"vocab":%s,"seq":%s,"batch":%s,"device_kernels":"%s","round":%s,"cpu":"%s","threads":%s,"date":"%s","step_s":%s}\n' \
                "$mesh" "$strategy" "$layers" "$hidden" "$heads" "$vocab" "$seq" "$batch" "$mode" "$round" "$CPU" "$(nproc)" "$(date -u +%F)" "$(median_step)"
        done
    done
done
