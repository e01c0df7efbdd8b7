#!/usr/bin/env python3
"""Print the memory table of docs/memory.md: peak memory per device and the largest batch that fits 80 GB,
for GPT-2 small and GPT-3 175B, optimus q x q against megatron 1 x q^2 at 4 and 64 devices, each recompute
setting and precision. Every number comes from `optimusc compile` + `optimusc inspect --json`.

Usage: python3 scripts/memory_table.py [--optimusc target/release/optimusc] [--precisions f32,bf16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = [("gpt2", "examples/gpt2.opt", "GPT-2 small, batch 8, seq 1024"), ("gpt3", "examples/gpt3.opt", "GPT-3 175B, batch 8, seq 2048")]
MESHES = [(4, ("optimus", "2x2"), ("megatron", "1x4")), (64, ("optimus", "8x8"), ("megatron", "1x64"))]


def gib(b: int) -> str:
    return f"{b / 2**30:.2f}"


def inspect(optimusc: str, model: str, strategy: str, mesh: str, recompute: str, precision: str, memory: str):
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.json"
        cmd = [optimusc, "compile", model, "--strategy", strategy, "--mesh", mesh, "--recompute", recompute,
               "--precision", precision, "-o", str(plan)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            first = next((l for l in done.stderr.splitlines() if l.startswith("error")), "error")
            return first.split(": ", 1)[-1]
        out = subprocess.run([optimusc, "inspect", str(plan), "--json", "--memory", memory],
                             capture_output=True, text=True, cwd=REPO, check=True)  # fmt: skip
        report = json.loads(out.stdout)
        return report["memory"], report.get("max_batch", {}).get("max_batch")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimusc", default=str(REPO / "target" / "release" / "optimusc"))
    parser.add_argument("--precisions", default="f32,bf16")
    parser.add_argument("--memory", default="80GB")
    args = parser.parse_args()
    precisions = [p for p in args.precisions.split(",") if p]
    for name, path, title in MODELS:
        print(f"\n{title}: peak GiB per device (kept activations GiB) / largest batch in {args.memory}\n")
        print("| devices | strategy | mesh | recompute | " + " | ".join(precisions) + " |")
        print("|---|---|---|---|" + "---|" * len(precisions))
        for devices, *sides in MESHES:
            for strategy, mesh in sides:
                for recompute in ["none", "selective", "layers"]:
                    cells = []
                    for precision in precisions:
                        got = inspect(args.optimusc, path, strategy, mesh, recompute, precision, args.memory)
                        if isinstance(got, str):
                            cells.append(f"does not compile: {got}")
                            continue
                        memory, batch = got
                        kept = memory["activations_kept_for_backward"]
                        cells.append(f"{gib(memory['peak_bytes'])} ({gib(kept)}) / {batch}")
                    print(f"| {devices} | {strategy} | {mesh} | {recompute} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
