#!/usr/bin/env bash
# The CPU products side by side: each point trains with faer (OPTIMUS_BLAS=faer) and with OpenBLAS
# (the default where libopenblas.so.0 is installed), alternating, for ROUNDS rounds, under --profile;
# prints one JSON line per run: the median step after the first, the MatMul row's GFLOP/s and % of
# the measured peak, and the library. Usage: scripts/bench_products.sh [ROUNDS] > results.jsonl
# (not part of the test suite: timings need a quiet machine; compare each point's fastest round).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-2}"
R=target/release/optimusc
[ -x "$R" ] || { echo "build it first: cargo build --release" >&2; exit 1; }
CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//') ($(grep -q avx512f /proc/cpuinfo && echo AVX-512 || echo AVX2))"
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
summary() {
    python3 - "$LOG" <<'PY'
import json, re, statistics, sys
lines = open(sys.argv[1]).read().splitlines()
elapsed = [json.loads(l)["elapsed_s"] for l in lines if l.startswith("{") and "elapsed_s" in l]
step = statistics.median([b - a for a, b in zip(elapsed, elapsed[1:])])
row = next(l.split() for l in lines if l.startswith("MatMul "))
library = next(re.sub(r".*CPU products by ", "", l) for l in lines if "CPU products by" in l)
print(json.dumps({"step_s": step, "matmul_gflops": float(row[5]), "matmul_peak_pct": float(row[6]), "library": library}))
PY
}
# Points: layers/hidden/heads/vocab/seq/batch, GPT-2 shaped, with the mesh and strategy.
for point in "1x1 optimus 4 256 8 8192 128 8" "1x1 optimus 3 384 6 16384 128 8" "1x1 optimus 2 768 12 50257 128 4" \
    "2x2 optimus 4 256 8 8192 128 8" "1x2 megatron 4 256 8 8192 128 8"; do
    read -r mesh strategy layers hidden heads vocab seq batch <<<"$point"
    sets="--set layers=$layers --set hidden=$hidden --set heads=$heads --set vocab=$vocab --set seq=$seq --set batch=$batch"
    for round in $(seq "$ROUNDS"); do
        for blas in faer default; do
            # shellcheck disable=SC2086
            if [ "$blas" = faer ]; then export OPTIMUS_BLAS=faer; else unset OPTIMUS_BLAS; fi
            # shellcheck disable=SC2086
            $R run examples/gpt2.opt --mesh "$mesh" --strategy "$strategy" $sets --steps 6 --profile --json >"$LOG" 2>&1
            printf '{"mesh":"%s","strategy":"%s","layers":%s,"hidden":%s,"heads":%s,"vocab":%s,"seq":%s,"batch":%s,"round":%s,"cpu":"%s","threads":%s,"date":"%s","run":%s}\n' \
                "$mesh" "$strategy" "$layers" "$hidden" "$heads" "$vocab" "$seq" "$batch" "$round" "$CPU" "$(nproc)" "$(date -u +%F)" "$(summary)"
        done
    done
done
