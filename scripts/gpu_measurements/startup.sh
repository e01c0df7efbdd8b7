#!/usr/bin/env bash
# Seconds from the start of `optimusc run` to the end of GPT-2 small's first bf16 step on the GPU, with an
# empty PTX cache and then with the entry the first run wrote. A measurement, not a test (gpu_check.sh
# runs it). Usage: startup.sh OPTIMUSC
set -euo pipefail
optimusc=$1
OPTIMUS_CACHE_DIR=$(mktemp -d)
export OPTIMUS_CACHE_DIR
for cache in empty filled; do
    start=$(date +%s.%N)
    OPTIMUS_TRACE_STARTUP=1 "$optimusc" run examples/gpt2.opt --set pdrop=0.0 --backend cuda --precision bf16 \
        --steps 1 > /dev/null
    end=$(date +%s.%N)
    python3 -c "import json; print(json.dumps({'ptx_cache': '$cache', 'first_step_done_s': round($end - $start, 2)}))"
done
ls -la "$OPTIMUS_CACHE_DIR/ptx"
rm -rf "$OPTIMUS_CACHE_DIR"
