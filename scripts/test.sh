#!/usr/bin/env bash
# The whole test suite, as CI runs it: formatting, lints, then every test.
# Installs nothing system-wide today; later stages add their own installs here.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== rustfmt"
cargo fmt --all -- --check

echo "== clippy (-D warnings)"
cargo clippy --all-targets --locked -- -D warnings

echo "== tests"
cargo test --all-targets --locked
