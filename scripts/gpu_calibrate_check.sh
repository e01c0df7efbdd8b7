#!/usr/bin/env bash
# The GPU check of `optimusc calibrate --backend cuda` (issue 28's simulator line, issue 29's shared-GPU
# one), in about 3 minutes: the kernel tests and the run tests with OPTIMUS_REQUIRE_CUDA=1, the
# calibration itself (its profile kept as gpu.toml, its raw measurements as samples.jsonl), and
# `simulate --hardware gpu.toml` against measured steps on models and meshes the calibration did not run
# (scripts/gpu_measurements/simulate_check.py). Optional steps: PROFILE=1, GPU-timed profiles of bf16
# GPT-2 small and TinyLlama steps; BASELINE=PATH, TinyLlama's step with an older optimusc beside this
# one (scripts/steps_ab.py), which also takes over the calibration and the check if
# this build's kernel tests fail. CUDA_RUN_FILTER picks run tests. Run scripts/gpu_prepare.sh first
# where Rust is and bring .gpu/ along. Results go to $OUT: logs (the small ones in measurements.log),
# gpu.toml, samples.jsonl, simulate.jsonl and ab.jsonl (the raw results to commit under bench/results/).
# SKIP="step ..." leaves steps out. Prints a summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
GPT2_SMALL=(--set layers=12 --set hidden=768 --set heads=12 --set vocab=50257 --set seq=1024 --set context=1024
    --set batch=8 --set pdrop=0.0)
OPTIMUSC="$BIN/optimusc"
run_step cuda_kernels 150 "$BIN/cuda_kernels" --test-threads=1
if [ -n "${BASELINE:-}" ] && ! grep -q "^test result: ok" "$OUT/cuda_kernels.log"; then
    echo "the kernel tests failed: the calibration and the check use the baseline build"
    OPTIMUSC="$BASELINE"
fi
run_step cuda_run 240 "$BIN/cuda_run" --test-threads=2 ${CUDA_RUN_FILTER:-}
if [ -n "${BASELINE:-}" ]; then
    run_step tinyllama_ab 120 python3 scripts/steps_ab.py --new "$BIN/optimusc" --baseline "$BASELINE" \
        --label tinyllama --jsonl "$OUT/ab.jsonl" -- examples/tinyllama.opt --backend cuda --precision bf16 \
        --set batch=4 --lr 1e-4
fi
if [ "${PROFILE:-0}" = 1 ]; then
    TAIL_LINES=45 run_step profile 90 "$OPTIMUSC" run examples/gpt2.opt --backend cuda --precision bf16 \
        "${GPT2_SMALL[@]}" --steps 3 --lr 1e-4 --profile
    TAIL_LINES=40 run_step profile_tinyllama 90 "$OPTIMUSC" run examples/tinyllama.opt --backend cuda \
        --precision bf16 --set batch=4 --steps 3 --lr 1e-4 --profile
fi
run_step calibrate 330 "$OPTIMUSC" calibrate --backend cuda -o "$OUT/gpu.toml" --samples "$OUT/samples.jsonl"
TAIL_LINES=14 run_step simulate_check 240 python3 scripts/gpu_measurements/simulate_check.py --optimusc "$OPTIMUSC" \
    --profile "$OUT/gpu.toml" --jsonl "$OUT/simulate.jsonl" ${CHECK_ARGS:-}
# At most 8 files come back from a device call: the small logs go into one.
(cd "$OUT" && cat gpu.txt cuda_kernels.log cuda_run.log tinyllama_ab.log profile.log profile_tinyllama.log \
    > measurements.log 2>/dev/null;
    rm -f gpu.txt cuda_kernels.log cuda_run.log tinyllama_ab.log profile.log profile_tinyllama.log)
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $status
