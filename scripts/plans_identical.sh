#!/usr/bin/env bash
# Compiles every example with two optimusc binaries and checks that the plans are byte-identical:
# a refactor of the compiler (e.g. of the sharding rules) must not change any plan.
#
#   scripts/plans_identical.sh BASE_BIN NEW_BIN [EXAMPLE.opt ...]
#
# Meshes: optimus 2x2 and 4x4, megatron 1x4, none 1x1, the data-parallel meshes 2x2x2 (optimus)
# and 2x1x4 (megatron) with --zero 0 and --zero 1, and 2x2x2 under 3d and tesseract; each in train
# and infer mode, in f32 and bf16, with --set layers=2. Few tokens (the products keeping weights in
# place): PLANS_EXTRA_ARGS="--set hidden=512 --set batch=2 --set seq=4". A configuration that fails to compile must fail the same way with both binaries
# (same exit status and messages). Exit status 0 when every configuration agrees, 1 otherwise.
# Extra compile arguments for every configuration may be given in PLANS_EXTRA_ARGS, e.g.
# PLANS_EXTRA_ARGS="--recompute selective".
set -u

if [ $# -lt 2 ]; then
  echo "usage: $0 BASE_BIN NEW_BIN [EXAMPLE.opt ...]" >&2
  exit 2
fi
base=$1
new=$2
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -gt 0 ]; then examples=("$@"); else examples=("$root"/examples/*.opt); fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# strategy|mesh|zero
meshes=(
  "optimus|2x2|0"
  "optimus|4x4|0"
  "megatron|1x4|0"
  "none|1x1|0"
  "optimus|2x2x2|0"
  "optimus|2x2x2|1"
  "megatron|2x1x4|0"
  "megatron|2x1x4|1"
  "3d|2x2x2|0"
  "tesseract|2x2x2|0"
)

compile() { # BIN OUT_PREFIX ARGS...
  local bin=$1 out=$2
  shift 2
  "$bin" compile "$@" -o "$out.json" >"$out.stdout" 2>"$out.stderr"
  echo $? >"$out.rc"
}

total=0
same=0
failed_both=0
differ=0
for model in "${examples[@]}"; do
  name=$(basename "$model" .opt)
  for m in "${meshes[@]}"; do
    IFS='|' read -r strategy mesh zero <<<"$m"
    for mode in train infer; do
      for precision in f32 bf16; do
        config="$name $strategy $mesh zero=$zero $mode $precision"
        args=("$model" --strategy "$strategy" --mesh "$mesh" --zero "$zero" --mode "$mode"
          --precision "$precision" --set layers=2)
        # shellcheck disable=SC2206
        [ -n "${PLANS_EXTRA_ARGS:-}" ] && args+=(${PLANS_EXTRA_ARGS})
        rm -f "$work"/base.* "$work"/new.*
        compile "$base" "$work/base" "${args[@]}"
        compile "$new" "$work/new" "${args[@]}"
        total=$((total + 1))
        # Messages name the binary that wrote them; compare them without it.
        sed -i "s#$base#OPTIMUSC#g" "$work/base.stderr" "$work/base.stdout"
        sed -i "s#$new#OPTIMUSC#g" "$work/new.stderr" "$work/new.stdout"
        if ! cmp -s "$work/base.rc" "$work/new.rc" || ! cmp -s "$work/base.stderr" "$work/new.stderr"; then
          echo "DIFFERENT  $config: exit status or messages differ"
          differ=$((differ + 1))
        elif [ "$(cat "$work/base.rc")" != 0 ]; then
          failed_both=$((failed_both + 1))
          echo "same error $config: $(grep -m1 -i error "$work/base.stderr")"
        elif cmp -s "$work/base.json" "$work/new.json"; then
          same=$((same + 1))
        else
          echo "DIFFERENT  $config: plans differ"
          diff <(python3 -m json.tool "$work/base.json") <(python3 -m json.tool "$work/new.json") | head -20
          differ=$((differ + 1))
        fi
      done
    done
  done
done

echo "$total configurations: $same plans byte-identical, $failed_both fail identically with both, $differ differ"
[ "$differ" -eq 0 ]
