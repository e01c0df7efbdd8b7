#!/usr/bin/env bash
# Benchmark, not a test: training tokens/s and MFU of `optimusc run --backend cuda` against PyTorch
# (eager, SDPA, torch.compile) on the same GPU, side by side in one run. Run it on a GPU machine with
# PyTorch and transformers, from the repository root, with a release optimusc built by
# `cargo build --release --features cuda` (pass --optimusc PATH if it is elsewhere). Arguments go to
# scripts/bench_gpu.py (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "bench_gpu: needs a GPU and python3 with torch (CUDA) and transformers" >&2
    exit 1
fi
exec python3 scripts/bench_gpu.py "$@"
