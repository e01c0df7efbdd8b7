#!/usr/bin/env bash
# The whole test suite, as CI runs it: formatting, lints, then every test, with every feature.
# Installs what it needs itself: Open MPI and libclang (apt, for the `mpi` feature), NVRTC (the
# nvidia-cuda-nvrtc pip wheel, so CUDA kernels compile to PTX without a GPU), and PyTorch with
# transformers for the Hugging Face comparison (pip, into virtualenvs under ~/.cache/optimus).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== system packages: Open MPI and libclang for the mpi feature, OpenBLAS for the CPU products"
APT_PACKAGES=(libopenmpi-dev openmpi-bin libclang1-14 libclang-common-14-dev libopenblas0-pthread)
if ! dpkg -s "${APT_PACKAGES[@]}" >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${APT_PACKAGES[@]}"
fi

echo "== NVRTC for the cuda feature's PTX test (pip wheel, once, into ~/.cache/optimus/venv-nvrtc)"
NVRTC_VENV="${NVRTC_VENV:-$HOME/.cache/optimus/venv-nvrtc}"
NVRTC_LIB="$NVRTC_VENV/lib/python3.11/site-packages/nvidia/cuda_nvrtc/lib"
if ! ls "$NVRTC_LIB"/libnvrtc.so.12 >/dev/null 2>&1; then
    python3 -m venv "$NVRTC_VENV"
    "$NVRTC_VENV/bin/pip" install -q 'nvidia-cuda-nvrtc-cu12==12.6.*'
    NVRTC_LIB="$(dirname "$(find "$NVRTC_VENV" -name 'libnvrtc.so.12' | head -n 1)")"
fi
export LD_LIBRARY_PATH="$NVRTC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OPTIMUS_REQUIRE_NVRTC=1

echo "== rustfmt"
cargo fmt --all -- --check

echo "== clippy (-D warnings), default features and all features"
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy --workspace --all-targets --locked --all-features -- -D warnings

echo "== build with the cuda feature"
cargo build --workspace --locked --features cuda

echo "== tests (all features: MPI jobs of 4 and 9 processes, CUDA kernels to PTX)"
cargo test --workspace --all-targets --locked --all-features

echo "== Hugging Face GPT-2 comparison (installs torch and transformers once, into ~/.cache/optimus/venv-hf)"
bash scripts/hf_compare.sh
