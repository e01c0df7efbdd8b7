#!/usr/bin/env bash
# The whole GPU check of the CUDA backend, on a GPU machine, in about 5 minutes (at most 10): the kernel
# tests and the end-to-end run tests with OPTIMUS_REQUIRE_CUDA=1, the training benchmark against PyTorch
# (scripts/bench_gpu.py, flash and reference attention side by side), the cost of misaligned products
# (scripts/gpu_measurements/gemm_alignment.py) and a per-kernel profile of bf16 GPT-2 small steps. Run scripts/gpu_prepare.sh first where Rust is (the GPU machine has none) and
# bring .gpu/ along. Results go to $OUT (default /tmp/optimus-gpu-check): logs, bench.jsonl (the raw
# results to commit under bench/results/), profile.txt. Prints a summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-.gpu}"
OUT="${OUT:-/tmp/optimus-gpu-check}"
mkdir -p "$OUT"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"

# The run tests call optimusc at the path cargo gave it when they were built.
built_at=$(cat "$BIN/optimusc_path")
if [ ! -x "$built_at" ]; then
    mkdir -p "$(dirname "$built_at")" && ln -sf "$PWD/$BIN/optimusc" "$built_at"
fi

# The test binaries load NVRTC and cuBLAS as cudarc finds them: put the CUDA wheels' libraries of the
# machine's Python (PyTorch's) on the library path, as optimusc's own library discovery does.
wheels=$(python3 -c 'import glob, os, sys
print(":".join(sorted({os.path.dirname(p) for sp in sys.path if os.path.isdir(sp)
                        for p in glob.glob(os.path.join(sp, "nvidia", "*", "lib", "lib*.so*"))})))' 2>/dev/null)
export LD_LIBRARY_PATH="${wheels}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OPTIMUS_REQUIRE_CUDA=1 OPTIMUS_REQUIRE_FLASH=1 OPTIMUS_REQUIRE_NVRTC=1
summary=()
run_step() {  # name, timeout (s), command...; SKIP="name ..." leaves steps out
    local name=$1 limit=$2
    shift 2
    case " ${SKIP:-} " in *" $name "*) summary+=("$name: skipped"); return 0 ;; esac
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || status=1
    summary+=("$name: rc $rc in $((SECONDS - start)) s")
    tail -n "${TAIL_LINES:-8}" "$OUT/$name.log"
}

run_step cuda_kernels 150 "$BIN/cuda_kernels" --test-threads=1
run_step cuda_run 240 "$BIN/cuda_run" --test-threads=2
run_step bench 330 python3 scripts/bench_gpu.py --optimusc "$BIN/optimusc" --reference-attention \
    --jsonl "$OUT/bench.jsonl" ${BENCH_ARGS:-}
run_step gemm_alignment 60 python3 scripts/gpu_measurements/gemm_alignment.py
run_step startup 90 bash scripts/gpu_measurements/startup.sh "$BIN/optimusc"
run_step tinyllama 150 "$BIN/optimusc" run examples/tinyllama.opt --backend cuda --precision bf16 --lr 1e-4 \
    --set batch=${TINYLLAMA_BATCH:-4} --steps 5 --log "$OUT/tinyllama.jsonl"
OPTIMUS_CUDA_SYNC=1 run_step profile 90 "$BIN/optimusc" run examples/gpt2.opt --set pdrop=0.0 --lr 1e-3 \
    --backend cuda --precision bf16 --steps 4 --profile
# At most 8 files come back from a device call: the small logs go into one.
(cd "$OUT" && cat gpu.txt gemm_alignment.log startup.log tinyllama.log > measurements.log 2>/dev/null;
    rm -f gpu.txt gemm_alignment.log startup.log tinyllama.log)
echo "== bench"
tail -n 12 "$OUT/bench.log"
echo "== measurements"
grep -h '^{' "$OUT/measurements.log" | cut -c1-160
grep -h 'tokens/s' "$OUT/measurements.log" | tail -n 3
grep -h '^startup:\|ptx$' "$OUT/measurements.log"
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $status
