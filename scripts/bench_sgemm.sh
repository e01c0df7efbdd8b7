#!/usr/bin/env bash
# Our AVX2 product against OpenBLAS, alone, on GPT-2 small's product shapes (1x1 and one device of a
# 2x2 mesh), warm and cold (operands evicted between calls), one and two threads: one JSON line per
# shape and library with the CPU, the ISA cap and the date. Usage:
#   scripts/bench_sgemm.sh [avx2|avx512] [REPS] [--shape m,n,k,tl,tr ...] > results.jsonl
# (--shape, repeatable, measures those shapes instead: tl, tr 1 for a transposed left or right operand)
# avx2 (the default) narrows OpenBLAS to its Haswell kernels and the peak to AVX2 FMA, as
# OPTIMUS_CPU_ISA=avx2 does for optimusc; avx512 on an AVX-512 CPU asks OpenBLAS for its SkylakeX
# kernels, as optimusc does (an OpenBLAS older than the CPU would fall back to SSE3 ones), unless
# OPENBLAS_CORETYPE is set. Not part of the test suite: timings need a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
ISA="${1:-avx2}"
REPS="${2:-20}"
cargo build --release --quiet --example sgemm_shapes -p optimus-runtime
BIN=target/release/examples/sgemm_shapes
CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//') ($(grep -q avx512f /proc/cpuinfo && echo AVX-512 || echo AVX2))"
export OPTIMUS_CPU_ISA="$ISA"
if [ "$ISA" = avx2 ]; then
    export OPENBLAS_CORETYPE=Haswell
elif [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx512f /proc/cpuinfo; then
    export OPENBLAS_CORETYPE=SkylakeX
fi
for mode in warm cold; do
    flag=""
    [ "$mode" = cold ] && flag="--cold"
    # shellcheck disable=SC2086
    "$BIN" --reps "$REPS" $flag "${@:3}" | while read -r line; do
        printf '{"cpu":"%s","isa_cap":"%s","date":"%s",%s\n' "$CPU" "$ISA" "$(date -u +%F)" "${line#\{}"
    done
done
