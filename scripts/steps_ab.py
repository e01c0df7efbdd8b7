#!/usr/bin/env python3
"""Step times of two optimusc builds (or one build with and without an environment setting) on the same
run, alternating, in one call: a before/after, on a GPU or the CPU.

Usage: python3 scripts/steps_ab.py --new PATH [--baseline PATH] [--baseline-env VAR=VALUE]
           [--rounds 2] [--steps 6] [--warmup 2] [--label NAME] [--jsonl FILE] [--profile] -- RUN ARGS...

Runs `optimusc run RUN ARGS... --steps S --json` with each build, alternating, --rounds times (the
baseline is --baseline, else --new; --baseline-env settings apply to the baseline's runs only); a run's
step time is the median of the differences of `elapsed_s` after --warmup steps. Prints one line per
run and the faster round of each build; --jsonl appends one JSON record per run (raw results). With
two rounds or more it also prints how far apart each build's rounds were, and warns where they are
more than the ratio's distance from 1: a difference smaller than the machine's own spread is noise.
With --profile each run also takes `--profile` and reports its MatMul row: the products' GFLOP/s and
their share of the peak the run measured (the profile's warm-up step is left out there too).
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

from bench_noise import spread


def step_time(optimusc, run_args, steps, warmup, env=None, profile=False):
    """The median step time, the last loss and (with `profile`) the profile's MatMul row of one run."""
    command = [optimusc, "run", *run_args, "--steps", str(warmup + steps), "--json"]
    command += ["--profile"] if profile else []
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()[-400:]}")
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{\"elapsed_s\"")]
    elapsed = [r["elapsed_s"] for r in records]
    times = [b - a for a, b in zip(elapsed, elapsed[1:])][max(warmup - 1, 0):]
    if not times:
        raise RuntimeError("the run printed too few steps to time")
    return statistics.median(times), records[-1]["loss"], products_row(done.stdout) if profile else None


def products_row(stdout):
    """The MatMul row of the run's `{"profile": ...}` record: GFLOP/s and % of the measured peak."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{\"profile\""):
            profile = json.loads(line)["profile"]
            row = next((r for r in profile["rows"] if r["name"] == "MatMul"), None)
            if row is None:
                raise RuntimeError("the profile has no MatMul row")
            return {"matmul_gflops": row["gflops"], "matmul_peak_pct": row["peak_pct"],
                    "matmul_share_pct": row["share_pct"], "peak_gflops": profile["peak_gflops"]}
    raise RuntimeError("the run printed no profile record")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", required=True)
    parser.add_argument("--baseline", help="the older build (default: --new)")
    parser.add_argument("--baseline-env", action="append", default=[], metavar="VAR=VALUE",
                        help="set for the baseline's runs only (repeatable)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--label", default="run")
    parser.add_argument("--jsonl")
    parser.add_argument("--profile", action="store_true", help="also report each run's MatMul row")
    parser.add_argument("run_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    run_args = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    baseline_env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.baseline_env))
    builds = (("baseline", args.baseline or args.new, baseline_env), ("new", args.new, None))
    best = {}
    times = {"baseline": [], "new": []}
    for round_ in range(1, args.rounds + 1):
        for build, path, env in builds:
            try:
                seconds, loss, products = step_time(path, run_args, args.steps, args.warmup, env, args.profile)
            except RuntimeError as e:
                print(f"{args.label} {build} round {round_}: failed: {e}", flush=True)
                continue
            best[build] = min(best.get(build, seconds), seconds)
            times[build].append(seconds)
            shown = f", products at {products['matmul_peak_pct']:.1f}% of the peak" if products else ""
            print(f"{args.label} {build} round {round_}: {seconds * 1e3:.2f} ms a step, last loss {loss:.4f}{shown}",
                  flush=True)
            if args.jsonl:
                setting = args.baseline_env if build == "baseline" else []
                record = {"system": f"optimusc {build}", "label": args.label, "args": run_args, "env": setting,
                          "round": round_,
                          "step_s": seconds, "last_loss": loss, "date": datetime.date.today().isoformat(),
                          **(products or {})}
                with open(args.jsonl, "a", encoding="utf-8") as out:
                    out.write(json.dumps(record) + "\n")
    if len(best) == 2:
        print(f"{args.label}: new {best['new'] * 1e3:.2f} ms against baseline {best['baseline'] * 1e3:.2f} ms "
              f"(faster round each): {best['baseline'] / best['new']:.3f}x")
        report_spread(args.label, times, best['baseline'] / best['new'])
    return 0 if len(best) == 2 else 1


def report_spread(label, times, ratio):
    """How far each build's slowest round is above its fastest; a warning where that spread is larger
    than the measured difference (the ratio's distance from 1)."""
    spreads = {b: spread(t) for b, t in times.items() if len(t) > 1}
    if not spreads:
        return
    print(f"{label}: rounds apart: " + ", ".join(f"{b} {100 * v:.1f}%" for b, v in sorted(spreads.items()))
          + " (slowest round over fastest)")
    if max(spreads.values()) > abs(ratio - 1.0):
        print(f"{label}: warning: the rounds are further apart than the two builds: the ratio is within "
              "this machine's noise; run more rounds or on a quieter machine", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
