#!/usr/bin/env bash
# usage: cmp.sh BIN config... ; prints median tokens/s of 1x1 and 2x2
BIN=${BIN:-/work/main/target/release/optimusc}
cd /work/main
run() { # sizes mesh strategy
  read L H NH V S B <<<"$1"
  $BIN run examples/gpt2.opt --mesh $2 --strategy $3 --set layers=$L --set hidden=$H --set heads=$NH --set vocab=$V --set context=$S --set seq=$S --set batch=$B --set pdrop=0.0 --steps ${STEPS:-7} --json --lr 1e-3 2>/dev/null | python3 -c 'import sys,json,statistics; r=[json.loads(l)["tokens_per_s"] for l in sys.stdin]; print(round(statistics.median(r[1:])))'
}
for cfg in "$@"; do
  case $cfg in small) s="4 256 8 8192 128 8";; mid) s="4 512 8 32768 128 8";; wide) s="2 768 12 50257 128 4";; esac
  for r in 1 2; do
    a=$(run "$s" 1x1 none); b=$(run "$s" 2x2 optimus); c=$(run "$s" 1x4 megatron)
    echo "$cfg round $r: 1x1 $a  2x2 $b ($(python3 -c "print(round($b/$a,3))"))  1x4 $c ($(python3 -c "print(round($c/$a,3))"))"
  done
done
