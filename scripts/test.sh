#!/usr/bin/env bash
# The whole test suite, as CI runs it: formatting, lints, then every test.
# Installs what it needs itself: PyTorch and transformers (pip, into a virtualenv under
# ~/.cache/optimus) for the Hugging Face comparison.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== rustfmt"
cargo fmt --all -- --check

echo "== clippy (-D warnings)"
cargo clippy --all-targets --locked -- -D warnings

echo "== tests"
cargo test --all-targets --locked

echo "== Hugging Face GPT-2 comparison (installs torch and transformers once, into ~/.cache/optimus/venv-hf)"
bash scripts/hf_compare.sh
