#!/usr/bin/env bash
# The whole GPU check of the CUDA backend, on a GPU machine, in about 5 minutes (at most 10): the kernel
# tests and the end-to-end run tests with OPTIMUS_REQUIRE_CUDA=1, the training benchmark against PyTorch
# (scripts/bench_gpu.py, flash and reference attention, eight-wide and scalar elementwise kernels side by
# side), the cost of misaligned products (scripts/gpu_measurements/gemm_alignment.py) and the GPU time of
# every kernel of a bf16 GPT-2 small step (scripts/gpu_measurements/kernel_times.sh). Run
# scripts/gpu_prepare.sh first where Rust is (the GPU machine has none) and bring .gpu/ along. Results go
# to $OUT (default /tmp/optimus-gpu-check): logs, bench.jsonl (the raw results to commit under
# bench/results/), kernels_1x1.csv and kernel_times.log. Prints a summary last. BASELINE=PATH also runs
# an older optimusc (built by gpu_prepare.sh from another commit) in the benchmark and on TinyLlama, for a
# before/after measured in the same call; BENCH_ARGS replaces the benchmark's extra rows (default: the
# reference attention and the scalar kernels); SKIP="step ..." leaves steps out.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"

run_step cuda_kernels 150 "$BIN/cuda_kernels" --test-threads=1
run_step cuda_run 240 "$BIN/cuda_run" --test-threads=2
# BASELINE (a path, optional): an older optimusc measured in the same call, for a before/after.
baseline_args=()
[ -n "${BASELINE:-}" ] && baseline_args=(--baseline "$BASELINE")
run_step bench 330 python3 scripts/bench_gpu.py --optimusc "$BIN/optimusc" "${baseline_args[@]}" \
    --jsonl "$OUT/bench.jsonl" ${BENCH_ARGS:---reference-attention --scalar-kernels}
run_step gemm_alignment 60 python3 scripts/gpu_measurements/gemm_alignment.py
run_step startup 90 bash scripts/gpu_measurements/startup.sh "$BIN/optimusc"
run_step tinyllama 150 "$BIN/optimusc" run examples/tinyllama.opt --backend cuda --precision bf16 --lr 1e-4 \
    --set batch=${TINYLLAMA_BATCH:-4} --steps 5 --log "$OUT/tinyllama.jsonl"
if [ -n "${BASELINE:-}" ]; then
    run_step tinyllama_baseline 150 "$BASELINE" run examples/tinyllama.opt --backend cuda --precision bf16 --lr 1e-4 \
        --set batch=${TINYLLAMA_BATCH:-4} --steps 5 --log "$OUT/tinyllama_baseline.jsonl"
fi
# GPU time of every kernel of a step (Nsight Compute), not the host-timed OPTIMUS_CUDA_SYNC profile,
# which counts a wait of about 10 us into every small kernel.
run_step kernel_times 120 bash scripts/gpu_measurements/kernel_times.sh "$BIN/optimusc" "$OUT/kernels_1x1.csv" \
    --precision bf16 --set pdrop=0.0 --lr 1e-3
# At most 8 files come back from a device call: the small logs go into one.
(cd "$OUT" && cat gpu.txt gemm_alignment.log startup.log tinyllama.log tinyllama_baseline.log tinyllama*.jsonl \
    > measurements.log 2>/dev/null;
    rm -f gpu.txt gemm_alignment.log startup.log tinyllama.log tinyllama_baseline.log tinyllama*.jsonl)
echo "== bench"
tail -n 12 "$OUT/bench.log" 2>/dev/null
echo "== measurements"
grep -h '^{' "$OUT/measurements.log" | cut -c1-160
grep -h 'tokens/s' "$OUT/measurements.log" | tail -n 3
grep -h '^startup:\|ptx$' "$OUT/measurements.log"
echo "== kernels (GPU time of one 1x1 step)"
head -n 16 "$OUT/kernel_times.log" 2>/dev/null
grep -h '^step:' "$OUT/kernel_times.log" 2>/dev/null
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $status
