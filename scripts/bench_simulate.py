#!/usr/bin/env python3
"""Predicted against measured step times on this machine: `optimusc simulate --hardware PROFILE`
beside `optimusc run` (CPU threads) over a grid of meshes, strategies, sizes and modes.

Usage: python3 scripts/bench_simulate.py [--profile FILE.toml] [--optimusc PATH] [--full]
                                         [--steps N] [--repeats R] [--model FILE.opt] [--layers L]
                                         [--batch B] [--vocab V] [--overlap] [--jsonl FILE]

Without --profile it runs `optimusc calibrate` first. Prints one line per grid point (predicted,
measured, error) and the mean and worst absolute error. The measured step time is the median of the
second half of a point's steps (at least --steps, and enough for about --seconds of them: small steps
take a few to warm up), the fastest of --repeats rounds over the whole grid. (Before 2026-11-27 it was
the median of the steps after the first, with a fixed step count.) Then how far apart each point's
rounds were (each round's time is in --jsonl), with a warning where the median point's rounds are
more than 10% apart: that is the machine's own noise, not the simulator's error. With --overlap, every point is
compiled with `--overlap` for both the prediction and the run, and also run without it in the same
round, side by side (the last column is the overlapped step over the plain one).
--jsonl writes one JSON record per point (raw results). Not part of the test suite: timings need a
quiet machine.
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_noise import UNSTEADY, spread

MESHES = [("1x1", "none"), ("1x2", "megatron"), ("1x4", "megatron"), ("2x2", "optimus"), ("4x4", "optimus")]
HIDDEN = [128, 256, 512, 768]
SEQ = [64, 128, 256]
MODES = ["train", "infer"]


def grid(full):
    """Every combination with --full; else each mesh and mode at three (hidden, seq) corners."""
    if full:
        return list(itertools.product(MESHES, HIDDEN, SEQ, MODES))
    sizes = [(128, 64), (256, 128), (768, 256)]
    return [(m, h, s, mode) for m in MESHES for (h, s) in sizes for mode in MODES]


def overrides(args, hidden, seq):
    heads = max(4, hidden // 64)
    sets = {"layers": args.layers, "hidden": hidden, "heads": heads, "seq": seq, "batch": args.batch,
            "vocab": args.vocab, "context": max(seq, 64)}
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def steps_for(args, predicted_s):
    """Steps to run a point for: at least --steps, and enough for about --seconds of steady state
    (small steps warm up over their first few: lazily started threads and first-touched memory), at
    most 400."""
    wanted = int(args.seconds / max(predicted_s, 1e-4))
    return max(args.steps, min(400, 2 * wanted))


def one_run(args, target, steps):
    """The median wall time of the second half of the steps, from `run --json` records."""
    cmd = [args.optimusc, "run", args.model, *target, "--steps", str(steps), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")
    elapsed = [json.loads(line)["elapsed_s"] for line in out.stdout.splitlines()
               if line.startswith("{") and "elapsed_s" in line]
    times = [b - a for a, b in zip(elapsed, elapsed[1:])]
    if not times:
        raise RuntimeError("run printed too few steps to time")
    return statistics.median(times[len(times) // 2:])


def predicted_step(args, target):
    cmd = [args.optimusc, "simulate", args.model, *target, "--hardware", args.profile, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")
    sim = json.loads(out.stdout)
    return sim["step_time_s"], sim["compute_s"], sim["exposed_communication_s"]


def cpu_name():
    """The CPU's model name and its widest vector extension, from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown"
    name = next((l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name")), "unknown")
    flags = next((l.split(":", 1)[1].split() for l in info.splitlines() if l.startswith("flags")), [])
    width = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE"
    cap = os.environ.get("OPTIMUS_CPU_ISA")
    capped = f", capped to {cap} by OPTIMUS_CPU_ISA" if cap else ""
    return f"{name} ({width}{capped})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p.add_argument("--optimusc", default=os.path.join(root, "target", "release", "optimusc"))
    p.add_argument("--profile", help="a profile from `optimusc calibrate` (default: calibrate now)")
    p.add_argument("--model", default=os.path.join(root, "examples", "gpt2.opt"))
    p.add_argument("--full", action="store_true", help="every mesh x hidden x seq x mode (120 points)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seconds", type=float, default=1.0,
                   help="steady-state seconds to time per point (more steps for small ones; default 1)")
    p.add_argument("--repeats", type=int, default=2, help="rounds over the grid; each point's fastest counts")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--overlap", action="store_true", help="predict and run with --overlap, beside plain runs")
    p.add_argument("--jsonl", help="write one JSON record per point to this file")
    args = p.parse_args()
    if not os.path.exists(args.optimusc):
        sys.exit(f"no optimusc at {args.optimusc}: build it with `cargo build --release`")
    if args.profile is None:
        args.profile = os.path.join(tempfile.mkdtemp(), "calibrated.toml")
        subprocess.run([args.optimusc, "calibrate", "-o", args.profile], check=True)
    points = grid(args.full)
    plain = [["--mesh", mesh, "--strategy", strategy, "--mode", mode, *overrides(args, hidden, seq)]
             for (mesh, strategy), hidden, seq, mode in points]
    targets = [t + ["--overlap"] for t in plain] if args.overlap else plain
    predicted = [predicted_step(args, t) for t in targets]
    # Rounds over the whole grid, minutes apart: each point keeps its fastest round, so a slow spell
    # of a shared machine (another process, a noisy neighbour) during one run does not count.
    rounds = [[] for _ in points]
    without = [float("inf")] * len(points)
    for round_ in range(args.repeats):
        print(f"measuring: round {round_ + 1} of {args.repeats} over {len(points)} points", file=sys.stderr)
        for k, target in enumerate(targets):
            steps = steps_for(args, predicted[k][0])
            rounds[k].append(one_run(args, target, steps))
            if args.overlap:
                without[k] = min(without[k], one_run(args, plain[k], steps))
    measured = [min(r) for r in rounds]
    extra = "   plain     overlap/plain" if args.overlap else ""
    print(f"{'mesh':<5} {'strategy':<9} {'hidden':>6} {'seq':>4} {'mode':<5} "
          f"{'predicted':>10} {'measured':>10} {'error':>7}   compute / exposed comm{extra}")
    errors = []
    records = []
    for k, (((mesh, strategy), hidden, seq, mode), (step, compute, comm), real) in enumerate(
            zip(points, predicted, measured)):
        error = step / real - 1.0
        errors.append(error)
        line = (f"{mesh:<5} {strategy:<9} {hidden:>6} {seq:>4} {mode:<5} {1e3 * step:>8.1f}ms "
                f"{1e3 * real:>8.1f}ms {100 * error:>+6.1f}%   {1e3 * compute:.1f} / {1e3 * comm:.1f} ms")
        if args.overlap:
            line += f"   {1e3 * without[k]:>8.1f}ms  {real / without[k]:.3f}"
        print(line)
        records.append({"mesh": mesh, "strategy": strategy, "hidden": hidden, "seq": seq, "mode": mode,
                        "layers": args.layers, "batch": args.batch, "vocab": args.vocab,
                        "overlap": args.overlap, "predicted_s": step, "predicted_compute_s": compute,
                        "predicted_exposed_comm_s": comm, "measured_s": real,
                        "measured_without_overlap_s": without[k] if args.overlap else None,
                        "measured_rounds_s": rounds[k],
                        "steps": steps_for(args, step), "repeats": args.repeats, "cpu": cpu_name(),
                        "threads": os.cpu_count()})
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    worst = max(errors, key=abs)
    mean = statistics.mean(abs(e) for e in errors)
    print(f"\n{len(errors)} points: mean |error| {100 * mean:.1f}%, worst {100 * worst:+.1f}%")
    report_steadiness(rounds)


def report_steadiness(rounds):
    """How far apart each point's rounds were (slowest over fastest): a machine whose speed changes
    between rounds measures its own noise, and errors up to that spread say nothing of the simulator."""
    spreads = [spread(r) for r in rounds if len(r) > 1]
    if not spreads:
        return
    median, worst = statistics.median(spreads), max(spreads)
    print(f"rounds apart: median {100 * median:.1f}%, worst {100 * worst:.1f}% (slowest round over fastest)")
    if median > UNSTEADY:
        print("warning: this machine's speed changed between rounds by more than the simulator's 15% bar; "
              "its errors measure the machine, not the simulator: measure again on a quiet machine",
              file=sys.stderr)


if __name__ == "__main__":
    main()
