#!/usr/bin/env bash
# Builds, on a machine without a GPU, what scripts/gpu_check.sh runs on one: the release optimusc with the
# cuda feature and the CUDA test binaries, copied into .gpu/ (ignored by git), which the device call
# carries. The GPU machine has CUDA and PyTorch but no Rust.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
cargo build --release --locked --features cuda
tests=$(cargo test --release --locked --features cuda --test cuda_kernels --test cuda_run --test cuda_collectives --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("cuda_kernels", "cuda_run", "cuda_collectives"):
        print(m["executable"])')
rm -rf .gpu && mkdir -p .gpu
cp target/release/optimusc .gpu/
for t in $tests; do cp "$t" ".gpu/$(basename "$t" | sed 's/-[0-9a-f]*$//')"; done
strip .gpu/* 2>/dev/null || true
# The CUDA run tests find optimusc where cargo built it (CARGO_BIN_EXE_optimusc): gpu_check.sh links it there.
echo "$PWD/target/release/optimusc" > .gpu/optimusc_path
ls -la .gpu
