#!/usr/bin/env bash
# Build-time benchmark: a clean release build of optimusc at BASE and at the working tree, one after the
# other in fresh target folders (so neither shares compiled dependencies with the other), then what an
# edit to one CPU kernel rebuilds at the working tree. Prints one JSON line per measurement.
#
#   scripts/build_times.sh BASE_COMMIT [KERNEL_FILE]
#
# KERNEL_FILE defaults to crates/runtime/src/cpu/kernels.rs. Run it on a quiet machine: builds are timed
# by the wall clock. Needs about 3 GB of disk for the two target folders (removed afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: $0 BASE_COMMIT [KERNEL_FILE]}
kernel=${2:-crates/runtime/src/cpu/kernels.rs}
work=$(mktemp -d)
trap 'git worktree remove --force "$work/base" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
cores=$(nproc)

clean_build() { # LABEL DIR
    local label=$1 dir=$2 start end
    start=$(date +%s.%N)
    (cd "$dir" && CARGO_TARGET_DIR="$work/target-$label" cargo build --release --locked --bin optimusc -q)
    end=$(date +%s.%N)
    printf '{"measure":"clean release build","tree":"%s","seconds":%.1f,"cpu":"%s","cores":%s}\n' \
        "$label" "$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')" "$cpu" "$cores"
}

git worktree add --detach "$work/base" "$base" >/dev/null 2>&1
clean_build base "$work/base"
clean_build tree "$PWD"

# What one kernel edit rebuilds: touch the file and list the crates cargo compiles again.
touch "$kernel"
start=$(date +%s.%N)
rebuilt=$(CARGO_TARGET_DIR="$work/target-tree" cargo build --release --locked --bin optimusc 2>&1 |
    sed -n 's/^ *Compiling \([^ ]*\) .*/\1/p' | sort | tr '\n' ' ')
end=$(date +%s.%N)
printf '{"measure":"rebuild after editing %s","seconds":%.1f,"rebuilt":"%s"}\n' \
    "$kernel" "$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')" "${rebuilt% }"
