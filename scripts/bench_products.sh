#!/usr/bin/env bash
# The CPU products side by side: each point trains with faer (OPTIMUS_BLAS=faer) and with OpenBLAS
# (the default where libopenblas.so.0 is installed), alternating, for ROUNDS rounds, under --profile;
# prints one JSON line per run: the median step after the first, the MatMul row's GFLOP/s and % of
# the measured peak, the library found and the product calls each library ran (from the profile record). Usage: scripts/bench_products.sh [ROUNDS] > results.jsonl
# (not part of the test suite: timings need a quiet machine; compare each point's fastest round).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-2}"
# shellcheck source=scripts/bench_cpu.sh
source scripts/bench_cpu.sh
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
summary() {
    python3 - "$LOG" <<'PY'
import json, statistics, sys
records = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
elapsed = [r["elapsed_s"] for r in records if "elapsed_s" in r]
step = statistics.median([b - a for a, b in zip(elapsed, elapsed[1:])])
profile = next(r["profile"] for r in records if "profile" in r)
row = next(r for r in profile["rows"] if r["name"] == "MatMul")
calls = profile["cpu_product_calls"]
print(json.dumps({"step_s": step, "matmul_gflops": row["gflops"], "matmul_peak_pct": row["peak_pct"],
                  "library": profile["cpu_products"], "openblas_calls": calls["openblas"], "faer_calls": calls["faer"]}))
PY
}
# Points: layers/hidden/heads/vocab/seq/batch, GPT-2 shaped, with the mesh and strategy.
for point in "1x1 optimus 4 256 8 8192 128 8" "1x1 optimus 3 384 6 16384 128 8" "1x1 optimus 2 768 12 50257 128 4" \
    "2x2 optimus 4 256 8 8192 128 8" "1x2 megatron 4 256 8 8192 128 8"; do
    read -r mesh strategy layers hidden heads vocab seq batch <<<"$point"
    sets="--set layers=$layers --set hidden=$hidden --set heads=$heads --set vocab=$vocab --set seq=$seq --set batch=$batch"
    for round in $(seq "$ROUNDS"); do
        for blas in faer default; do
            if [ "$blas" = faer ]; then export OPTIMUS_BLAS=faer; else unset OPTIMUS_BLAS; fi
            # shellcheck disable=SC2086
            $R run examples/gpt2.opt --mesh "$mesh" --strategy "$strategy" $sets --steps 6 --profile --json >"$LOG" 2>&1
            printf '{"mesh":"%s","strategy":"%s","layers":%s,"hidden":%s,"heads":%s,"vocab":%s,"seq":%s,"batch":%s,"round":%s,"cpu":"%s","threads":%s,"date":"%s","run":%s}\n' \
                "$mesh" "$strategy" "$layers" "$hidden" "$heads" "$vocab" "$seq" "$batch" "$round" "$CPU" "$(nproc)" "$(date -u +%F)" "$(summary)"
        done
    done
done
