#!/usr/bin/env python3
"""Checks the memory plan against the CPU backend: for each configuration, the resident memory of
a whole `optimusc run` (maximum RSS from /usr/bin/time -v, release build) against the plan's peak
per device (`inspect --json`, memory.peak_bytes) times the devices.

Two ratios are printed:
  raw  = max RSS / (peak x devices)
  net  = (max RSS - baseline) / (peak x devices)
The baseline is the resident memory the process needs whatever the model: code, the device threads'
stacks, the kernel thread pool, the allocator's and MPI-free runtime's own state. It is measured, for
the same mesh and strategy, by running examples/tiny.opt (whose plan holds well under 1 MiB per
device) and subtracting its own plan total, so it counts no model memory. The plan does not count
this fixed overhead: it describes what the model needs on each device, not the process hosting them.

Usage: scripts/memory_check.py [--no-build] [--steps N] [--only NAME...]
See docs/memory.md.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "optimusc")

LARGE = ["--set", "layers=4", "--set", "seq=512", "--set", "batch=8"]
SMALL = ["--set", "layers=2", "--set", "seq=256", "--set", "vocab=8192", "--set", "batch=4"]

# (name, model, --set flags, mesh, strategy)
CONFIGS = [
    ("gpt2-large-2x2", "examples/gpt2.opt", LARGE, "2x2", "optimus"),
    ("gpt2-small-2x2", "examples/gpt2.opt", SMALL, "2x2", "optimus"),
    ("gpt2-small-1x4-megatron", "examples/gpt2.opt", SMALL, "1x4", "megatron"),
    ("gpt2-small-4x4", "examples/gpt2.opt", SMALL, "4x4", "optimus"),
]

VARIANTS = [("f32", "none"), ("f32", "layers"), ("bf16", "none"), ("bf16", "layers")]


def run(args, **kw):
    return subprocess.run(args, cwd=ROOT, check=True, capture_output=True, text=True, **kw)


def plan_bytes(model, sets, mesh, strategy, precision, recompute, tmp):
    """Per-device peak of the compiled plan and its path."""
    path = os.path.join(tmp, f"plan-{os.getpid()}.json")
    flags = ["--mesh", mesh, "--strategy", strategy, "--precision", precision, "--recompute", recompute]
    run([BIN, "compile", model, *sets, *flags, "-o", path])
    report = json.loads(run([BIN, "inspect", path, "--json"]).stdout)
    return report["memory"]["peak_bytes"], path


def max_rss_bytes(plan, steps):
    """Maximum resident set size of `optimusc run PLAN`, in bytes."""
    out = run(["/usr/bin/time", "-v", BIN, "run", plan, "--steps", str(steps), "--seed", "1"])
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr)
    if not found:
        sys.exit(f"no maximum resident set size in /usr/bin/time's output:\n{out.stderr}")
    return int(found.group(1)) * 1024


def devices(mesh):
    rows, cols = mesh.split("x")
    return int(rows) * int(cols)


def baseline(mesh, strategy, precision, steps, tmp):
    """Resident memory of a run whose plan is negligible (tiny.opt), less that plan's total."""
    peak, plan = plan_bytes("examples/tiny.opt", [], mesh, strategy, precision, "none", tmp)
    return max_rss_bytes(plan, steps) - peak * devices(mesh)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-build", action="store_true", help="use target/release/optimusc as it is")
    parser.add_argument("--steps", type=int, default=2, help="training steps per run (default 2)")
    parser.add_argument("--only", nargs="*", help="configuration names to run (default all)")
    args = parser.parse_args()
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--bin", "optimusc"], cwd=ROOT, check=True)
    mib = 1 << 20
    print("config | precision | recompute | devices | plan peak/device MiB | max RSS MiB | baseline MiB | raw | net")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        bases = {}
        for name, model, sets, mesh, strategy in CONFIGS:
            if args.only and name not in args.only:
                continue
            for precision, recompute in VARIANTS:
                key = (mesh, strategy, precision)
                if key not in bases:
                    bases[key] = baseline(mesh, strategy, precision, args.steps, tmp)
                base = bases[key]
                peak, plan = plan_bytes(model, sets, mesh, strategy, precision, recompute, tmp)
                rss = max_rss_bytes(plan, args.steps)
                total = peak * devices(mesh)
                raw, net = rss / total, (rss - base) / total
                worst = max(worst, abs(net - 1.0))
                print(
                    f"{name} | {precision} | {recompute} | {devices(mesh)} | {peak / mib:.1f} | "
                    f"{rss / mib:.1f} | {base / mib:.1f} | {raw:.3f} | {net:.3f}",
                    flush=True,
                )
    print(f"largest |net - 1|: {worst:.3f} (target: within 0.10)")


if __name__ == "__main__":
    main()
