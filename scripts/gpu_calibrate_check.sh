#!/usr/bin/env bash
# The GPU check of `optimusc calibrate --backend cuda` (issue 28's simulator line, issue 29's shared-GPU
# one), in about 4 minutes: the kernel tests and the run tests with OPTIMUS_REQUIRE_CUDA=1, GPU-timed
# profiles of bf16 GPT-2 small and TinyLlama steps, the calibration itself (its profile kept as gpu.toml), and
# `simulate --hardware gpu.toml` against measured steps on models and meshes the calibration did not run
# (scripts/gpu_measurements/simulate_check.py). Run scripts/gpu_prepare.sh first where Rust is and bring
# .gpu/ along. Results go to $OUT: logs, gpu.toml, simulate.jsonl (the raw results to commit under
# bench/results/). SKIP="step ..." leaves steps out. Prints a summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
GPT2_SMALL=(--set layers=12 --set hidden=768 --set heads=12 --set vocab=50257 --set seq=1024 --set context=1024
    --set batch=8 --set pdrop=0.0)
run_step cuda_kernels 150 "$BIN/cuda_kernels" --test-threads=1
run_step cuda_run 240 "$BIN/cuda_run" --test-threads=2
TAIL_LINES=45 run_step profile 90 "$BIN/optimusc" run examples/gpt2.opt --backend cuda --precision bf16 \
    "${GPT2_SMALL[@]}" --steps 3 --lr 1e-4 --profile
TAIL_LINES=40 run_step profile_tinyllama 90 "$BIN/optimusc" run examples/tinyllama.opt --backend cuda --precision bf16 \
    --set batch=4 --steps 3 --lr 1e-4 --profile
run_step calibrate 330 "$BIN/optimusc" calibrate --backend cuda -o "$OUT/gpu.toml" --samples "$OUT/samples.jsonl"
TAIL_LINES=12 run_step simulate_check 240 python3 scripts/gpu_measurements/simulate_check.py --optimusc "$BIN/optimusc" \
    --profile "$OUT/gpu.toml" --jsonl "$OUT/simulate.jsonl"
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $status
