#!/usr/bin/env python3
"""Communication a device sends per step, and its peak memory, for plans two optimusc builds make.

Deterministic (no timing): each build compiles each config (`optimusc compile`, train mode unless
`--mode` says otherwise), `optimusc inspect --json` reads the plan, and one JSON line per build and
config gives the bytes every device sends a step (`communication_totals` summed), of which the
transposes, the peak and the activations kept for the backward pass. A table of base -> new follows
on standard error. Not part of the test suite. Usage:

    scripts/bench_communication.py --base OLD_OPTIMUSC --new NEW_OPTIMUSC [--label-base C] \
        [--label-new C] [--configs train|small-batch|decode] [--jsonl FILE]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, model, --set arguments, mesh, extra compile arguments)
CONFIGS = [
    ("gpt2-small", "examples/gpt2.opt", [], "4x4", []),
    ("gpt2-small", "examples/gpt2.opt", [], "2x2", []),
    ("gpt2-small-16-heads-b64", "examples/gpt2.opt", ["heads=16", "batch=64"], "8x8", []),
    ("cpu-small 4/256/8/8192 seq 128 b8", "examples/gpt2.opt",
     ["layers=4", "hidden=256", "heads=8", "vocab=8192", "context=128", "seq=128", "batch=8", "pdrop=0.0"],
     "2x2", []),
    ("llama3-8b b64 x 2048 bf16", "examples/llama.opt", ["batch=64", "seq=2048"], "8x8",
     ["--precision", "bf16", "--recompute", "layers"]),
    ("gpt2-small tesseract", "examples/gpt2.opt", [], "2x4x4", ["--strategy", "tesseract"]),
    ("bert-large", "examples/bert.opt", [], "4x4", []),
    ("tinyllama", "examples/tinyllama.opt", [], "4x4", []),
]

# Training steps over a small batch of a wide model: `--configs small-batch`.
SMALL_BATCH_CONFIGS = [
    ("gpt2 2 x 512, 2 x 8 tokens", "examples/gpt2.opt",
     ["layers=2", "hidden=512", "heads=8", "vocab=512", "context=8", "seq=8", "batch=2", "pdrop=0.0"], "2x2", []),
    ("llama3-8b fine-tune, 8 x 256 tokens, bf16", "examples/llama.opt", ["batch=8", "seq=256"], "8x8",
     ["--precision", "bf16", "--recompute", "layers"]),
]

# Decoding steps (`--set seq=1` with key/value caches), compiled in inference mode: `--configs decode`.
DECODE_CONFIGS = [
    ("gpt2-small decode, 4 prompts", "examples/gpt2.opt", ["seq=1", "batch=4"], "2x2", ["--max-context", "1024"]),
    ("gpt2-small decode, 8 prompts", "examples/gpt2.opt", ["seq=1", "batch=8"], "4x4", ["--max-context", "1024"]),
    ("llama3-8b decode bf16, 8 prompts", "examples/llama.opt", ["seq=1", "batch=8"], "8x8",
     ["--max-context", "2048", "--precision", "bf16"]),
    ("gpt2-small prefill 128, 4 prompts", "examples/gpt2.opt", ["seq=128", "batch=4"], "2x2",
     ["--max-context", "1024"]),
]


def measure(binary, model, sets, mesh, extra, mode):
    """The inspect figures of one plan, or an error string."""
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.json"
        args = [binary, "compile", model, "--mesh", mesh, "--mode", mode, "-o", str(plan), *extra]
        for s in sets:
            args += ["--set", s]
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1:]}
        shown = subprocess.run([binary, "inspect", str(plan), "--json"], capture_output=True, text=True, check=True)
    report = json.loads(shown.stdout)
    totals = report["communication_totals"]
    memory = report["memory"]
    return {
        "bytes_per_device_per_step": sum(c["bytes"] for c in totals),
        "transpose_bytes": sum(c["bytes"] for c in totals if c.get("kind") == "transpose"),
        "collectives_per_device_per_step": sum(c.get("count", 0) for c in totals),
        "peak_bytes": memory.get("peak_bytes"),
        "activations_kept_for_backward": memory.get("activations_kept_for_backward"),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--new", required=True)
    parser.add_argument("--label-base", default="base")
    parser.add_argument("--label-new", default="new")
    parser.add_argument("--mode", default="train")
    parser.add_argument("--configs", choices=["train", "small-batch", "decode"], default="train",
                        help="the training configs (in --mode), or decoding steps (in inference mode)")
    parser.add_argument("--jsonl")
    args = parser.parse_args()
    out = open(args.jsonl, "a") if args.jsonl else sys.stdout
    rows = []
    configs = {"train": CONFIGS, "small-batch": SMALL_BATCH_CONFIGS, "decode": DECODE_CONFIGS}[args.configs]
    if args.configs == "decode":
        args.mode = "infer"
    for name, model, sets, mesh, extra in configs:
        figures = {}
        for label, binary in ((args.label_base, args.base), (args.label_new, args.new)):
            got = measure(binary, model, sets, mesh, extra, args.mode)
            line = {"binary": label, "config": name, "model": model, "sets": sets, "mesh": mesh,
                    "extra": extra, "mode": args.mode, **got}
            print(json.dumps(line), file=out, flush=True)
            figures[label] = got
        rows.append((name, mesh, figures[args.label_base], figures[args.label_new]))
    gib = 2.0**30
    for name, mesh, base, new in rows:
        if "error" in base or "error" in new:
            print(f"{name} {mesh}: {base.get('error') or new.get('error')}", file=sys.stderr)
            continue
        b, n = base["bytes_per_device_per_step"], new["bytes_per_device_per_step"]
        print(f"{name:36} {mesh:6} {b / gib:8.3f} -> {n / gib:8.3f} GiB ({(n / b - 1) * 100:+.1f}%)  "
              f"peak {base['peak_bytes'] / 2**20:.1f} -> {new['peak_bytes'] / 2**20:.1f} MiB", file=sys.stderr)


if __name__ == "__main__":
    main()
