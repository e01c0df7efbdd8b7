#!/usr/bin/env python3
"""Step times of two optimusc builds on the same run, alternating, in one call: a before/after.

Usage: python3 scripts/gpu_measurements/steps_ab.py --new PATH --baseline PATH [--rounds 2] [--steps 6]
           [--warmup 2] [--label NAME] [--jsonl FILE] -- RUN ARGS...

Runs `optimusc run RUN ARGS... --steps S --json` with each build, alternating, --rounds times; a run's
step time is the median of the differences of `elapsed_s` after --warmup steps. Prints one line per
run and the faster round of each build; --jsonl appends one JSON record per run (raw results).
"""

import argparse
import datetime
import json
import statistics
import subprocess
import sys


def step_time(optimusc, run_args, steps, warmup):
    command = [optimusc, "run", *run_args, "--steps", str(warmup + steps), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()[-400:]}")
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{\"elapsed_s\"")]
    elapsed = [r["elapsed_s"] for r in records]
    times = [b - a for a, b in zip(elapsed, elapsed[1:])][max(warmup - 1, 0):]
    if not times:
        raise RuntimeError("the run printed too few steps to time")
    return statistics.median(times), records[-1]["loss"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", required=True)
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--label", default="run")
    parser.add_argument("--jsonl")
    parser.add_argument("run_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    run_args = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    best = {}
    for round_ in range(1, args.rounds + 1):
        for build, path in (("baseline", args.baseline), ("new", args.new)):
            try:
                seconds, loss = step_time(path, run_args, args.steps, args.warmup)
            except RuntimeError as e:
                print(f"{args.label} {build} round {round_}: failed: {e}", flush=True)
                continue
            best[build] = min(best.get(build, seconds), seconds)
            print(f"{args.label} {build} round {round_}: {seconds * 1e3:.2f} ms a step, last loss {loss:.4f}",
                  flush=True)
            if args.jsonl:
                record = {"system": f"optimusc {build}", "label": args.label, "args": run_args, "round": round_,
                          "step_s": seconds, "last_loss": loss, "date": datetime.date.today().isoformat()}
                with open(args.jsonl, "a", encoding="utf-8") as out:
                    out.write(json.dumps(record) + "\n")
    if len(best) == 2:
        print(f"{args.label}: new {best['new'] * 1e3:.2f} ms against baseline {best['baseline'] * 1e3:.2f} ms "
              f"(faster round each): {best['baseline'] / best['new']:.3f}x")
    return 0 if len(best) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
