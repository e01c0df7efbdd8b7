#!/usr/bin/env bash
# Side by side on one machine: optimus 2x2 with the tied head keeping its table in place (NEW) and moving
# it (OLD, the build before a448ce8), each against the 1x1 plan, GPT-2 shapes layers/hidden/heads/vocab/seq/batch.
# Usage: OLD=path/to/old/optimusc NEW=path/to/new/optimusc bash ab.sh > results.jsonl
set -euo pipefail
cd "$(dirname "$0")/../../.."
run() { local bin=$1 mesh=$2; read -r L H NH V S Bt <<<"$3"
  RAYON_NUM_THREADS=2 "$bin" run examples/gpt2.opt --mesh "$mesh" --strategy optimus --set layers="$L" --set hidden="$H" \
    --set heads="$NH" --set vocab="$V" --set context="$S" --set seq="$S" --set batch="$Bt" --set pdrop=0.0 \
    --steps 7 --json --lr 1e-3 2>/dev/null |
    python3 -c 'import sys,json,statistics; r=[json.loads(l)["tokens_per_s"] for l in sys.stdin if "tokens_per_s" in l]; print(round(statistics.median(r[1:])))'; }
for config in "2 768 12 50257 128 4" "3 384 6 16384 128 8" "4 256 8 8192 128 8"; do
  for round in 1 2; do
    one=$(run "$NEW" 1x1 "$config"); new=$(run "$NEW" 2x2 "$config"); old=$(run "$OLD" 2x2 "$config")
    echo "{\"config\": \"$config\", \"round\": $round, \"tokens_per_s_1x1\": $one, \"optimus_2x2_in_place\": $new, \"optimus_2x2_moving\": $old}"
  done
done
