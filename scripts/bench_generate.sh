#!/usr/bin/env bash
# optimusc generate (with its key/value cache) against Hugging Face generate (PyTorch eager, with its cache), greedy, on the
# same threads: tokens/s of 64 new tokens after prompts of 8, 64 and 192 tokens, GPT-2 shaped
# (layers/hidden/heads 4/256/8, vocab 50257, context 256), one JSON line per run, ROUNDS rounds.
# Usage: scripts/bench_generate.sh [ROUNDS] > results.jsonl (not part of the test suite).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-2}"
# shellcheck source=scripts/bench_cpu.sh
source scripts/bench_cpu.sh
# shellcheck source=scripts/hf_venv.sh
source scripts/hf_venv.sh >&2
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
SETS="--set layers=4 --set hidden=256 --set heads=8 --set vocab=50257 --set context=256 --set pdrop=0"
# shellcheck disable=SC2086
$R run examples/gpt2.opt $SETS --set seq=16 --set batch=2 --steps 1 --save-weights "$WORK/model/" >/dev/null 2>&1
for round in $(seq "$ROUNDS"); do
    for prompt in 8 64 192; do
        ids="$(python3 -c "print(','.join(str((7 * k) % 50000) for k in range($prompt)))")"
        # shellcheck disable=SC2086
        ours="$($R generate examples/gpt2.opt $SETS --weights "$WORK/model/" --prompt-ids "$ids" --max-new-tokens 64 --json)"
        theirs="$("$PY" - "$WORK/model" "$prompt" <<'PY'
import sys, time, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = torch.tensor([[(7 * k) % 50000 for k in range(int(sys.argv[2]))]])
with torch.no_grad():
    model.generate(ids, do_sample=False, max_new_tokens=4, min_new_tokens=4, attention_mask=torch.ones_like(ids), pad_token_id=0)
    start = time.perf_counter()
    out = model.generate(ids, do_sample=False, max_new_tokens=64, min_new_tokens=64, attention_mask=torch.ones_like(ids), pad_token_id=0)
    took = time.perf_counter() - start
print(64 / took, ",".join(map(str, out[0].tolist())))
PY
)"
        python3 - "$ours" "$theirs" "$prompt" "$round" "$CPU" "$(nproc)" "$(date -u +%F)" "$(python3 -c 'import os; print(os.cpu_count())')" <<'PY'
import json, sys
ours, theirs, prompt, round_, cpu, threads, date, _ = sys.argv[1:]
ours = json.loads(ours)
rate, ids = theirs.split()
print(json.dumps({"prompt_tokens": int(prompt), "new_tokens": 64, "kv_cache": True, "round": int(round_), "cpu": cpu, "threads": int(threads),
                  "date": date, "optimusc_tokens_per_s": ours["tokens_per_s"], "hf_tokens_per_s": float(rate),
                  "same_tokens": ",".join(map(str, ours["ids"])) == ids}))
PY
    done
done
