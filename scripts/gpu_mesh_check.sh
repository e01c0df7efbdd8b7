#!/usr/bin/env bash
# The GPU check of meshes on one GPU (issue 29), in about 4 minutes: the collective tests on device
# pointers (shared-GPU against the thread fabric, NCCL with one-member groups), the end-to-end run tests,
# GPT-2 small's f32 losses on 2x2 and 2x2x2 against the CPU backend, and bf16 GPT-2 small steps on 1x1,
# 2x2 and 2x2x2 side by side (scripts/bench_gpu.py --only-optimusc), and a host-side profile of 2x2 steps. Run scripts/gpu_prepare.sh first
# where Rust is and bring .gpu/ along. Results go to $OUT: logs, mesh.jsonl (the raw results to commit
# under bench/results/). Prints a summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
export OPTIMUS_REQUIRE_NCCL=1
run_step cuda_collectives 120 "$BIN/cuda_collectives" --test-threads=1 --nocapture
run_step mesh_losses 150 python3 scripts/gpu_measurements/mesh_losses.py --optimusc "$BIN/optimusc"
grep -h '^{' "$OUT/mesh_losses.log" >> "$OUT/mesh.jsonl"
run_step bench 240 python3 scripts/bench_gpu.py --optimusc "$BIN/optimusc" --only-optimusc --steps 4 --warmup 2 \
    --meshes "${MESHES:-none:1x1,optimus:2x2,optimus:2x2x2}" --jsonl "$OUT/mesh.jsonl"
run_step profile 60 "$BIN/optimusc" run examples/gpt2.opt --backend cuda --precision bf16 --mesh 2x2 --steps 4 \
    --set pdrop=0.0 --lr 1e-3 --profile
run_step cuda_run 200 "$BIN/cuda_run" --test-threads=2
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $status
