#!/usr/bin/env bash
# Sourced by the CPU bench scripts: the release binary they time (R) and the CPU they ran on (CPU: its
# model name and vector width), for every JSON line they print.
R=target/release/optimusc
[ -x "$R" ] || { echo "build it first: cargo build --release" >&2; exit 1; }
CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//') ($(grep -q avx512f /proc/cpuinfo && echo AVX-512 || echo AVX2))"
export R CPU
