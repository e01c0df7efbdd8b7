#!/usr/bin/env bash
cd /work/main; B=./target/release/optimusc
run() { read L H NH V S Bt <<<"$1"; shift
  env "$@" RAYON_NUM_THREADS=2 $B run examples/gpt2.opt --mesh 2x2 --strategy optimus --set layers=$L --set hidden=$H --set heads=$NH --set vocab=$V --set context=$S --set seq=$S --set batch=$Bt --set pdrop=0.0 --steps 7 --json --lr 1e-3 2>/dev/null | python3 -c 'import sys,json,statistics; r=[json.loads(l)["tokens_per_s"] for l in sys.stdin]; print(round(statistics.median(r[1:])))'; }
for s in "2 768 12 50257 128 4" "4 256 8 8192 128 8"; do for r in 1 2; do echo "[$s] r$r: in place $(run "$s" X=1)  copies $(run "$s" OPTIMUS_BROADCAST_IN_PLACE=off)"; done; done
