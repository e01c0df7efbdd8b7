#!/usr/bin/env bash
# The GPU time of every kernel of one training step, read by Nsight Compute (each kernel timed alone,
# clocks left as they are), grouped by kernel: a measurement, not a test (the GPU check scripts run it).
# Three steps run; scripts/gpu_measurements/kernel_times.py finds the last step as the period of the
# launch sequence and prints its kernels by total time. Usage: kernel_times.sh OPTIMUSC OUT_CSV [run args...]
set -euo pipefail
optimusc=$1 csv=$2
shift 2
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1 || true)
[ -n "$ncu" ] || { echo "kernel_times: ncu is not on this machine" >&2; exit 1; }
"$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    "$optimusc" run examples/gpt2.opt --backend cuda --steps 3 "$@" > "$csv.raw" 2> "$csv.err" || {
    tail -n 20 "$csv.err" >&2; exit 1; }
grep '^"' "$csv.raw" > "$csv" || true
rm -f "$csv.raw" "$csv.err"
python3 "$(dirname "$0")/kernel_times.py" "$csv"
