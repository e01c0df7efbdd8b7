#!/usr/bin/env bash
# Benchmark, not a test: training tokens/s of `optimusc run` (none 1x1, optimus 2x2, megatron 1x2 and
# 1x4) against PyTorch eager GPT2LMHeadModel with the same sizes, side by side in one run on the same
# number of threads. Reuses the Hugging Face virtualenv of the test suite (scripts/hf_venv.sh) and a
# release build. Arguments go to scripts/bench_vs_torch.py (try --help): e.g. --configs small --steps 3.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/hf_venv.sh
source scripts/hf_venv.sh

echo "== cargo build --release"
cargo build --release --bin optimusc

exec "$PY" scripts/bench_vs_torch.py --optimusc "${CARGO_TARGET_DIR:-target}/release/optimusc" "$@"
