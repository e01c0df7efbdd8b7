#!/usr/bin/env python3
"""Predicted against measured pipeline steps on this CPU: `optimusc simulate --pipeline` with a
calibrated profile beside `optimusc run --pipeline` (threads), each run given the simulator's split
of the layers (`--pipeline-split`, read off simulate's per-stage layers), so both time the same stages.

GPT-2 shapes (4 layers, hidden 256, 8 heads, vocabulary 8192, sequence 128, batch 8); pipelines of
one-device, megatron 1x2, optimus 2x2 and data-parallel stages under 1F1B, GPipe and interleaved, and
one unpipelined point. The measured step is the median of the second half of 6 steps, the faster of
two rounds. Usage:
    python3 scripts/bench_pipeline_simulate.py [--profile FILE.toml] [--jsonl FILE]
Without --profile it runs `optimusc calibrate` first (about a minute). Not part of the test suite:
timings need a quiet machine. Build first: cargo build --release.
"""
import argparse
import json
import platform
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HIDDEN = 256
B = str(REPO / "target" / "release" / "optimusc")
MODEL = [str(REPO / "examples" / "gpt2.opt"), "--set", "layers=4", "--set", f"hidden={HIDDEN}", "--set", "heads=8",
         "--set", "vocab=8192", "--set", "seq=128", "--set", "batch=8"]
CASES = [
    ("1x1", "none", 2, "1f1b", 4), ("1x1", "none", 2, "gpipe", 4), ("1x1", "none", 4, "1f1b", 8),
    ("1x2", "megatron", 2, "1f1b", 4), ("2x2", "optimus", 2, "1f1b", 4), ("1x1", "none", 2, "interleaved", 4),
    ("2x1x1", "none", 2, "1f1b", 4), ("1x1", "none", 1, None, 4),
]
def find(o, key):
    if isinstance(o, dict):
        if key in o: return o[key]
        for v in o.values():
            r = find(v, key)
            if r is not None: return r
def counts(per_stage, p):
    # per_stage[s]["layers"] is a list of chunk descriptions; virtual stage c*p+s
    chunks = len(per_stage[0]["layers"])
    out = [0] * (p * chunks)
    for s, st in enumerate(per_stage):
        for c, text in enumerate(st["layers"]):
            n = 0
            for a, b in re.findall(r"h\.(\d+)(?:\.\.(\d+))?", text):
                n += (int(b) - int(a) + 1) if b else 1
            out[c * p + s] = n
    return out
def measure(flags):
    best = None
    for _ in range(2):
        out = subprocess.run([B, "run", *MODEL, *flags, "--steps", "6", "--json"], capture_output=True, text=True)
        recs = [json.loads(l) for l in out.stdout.splitlines() if '"loss"' in l]
        el = [r["elapsed_s"] for r in recs]
        steps = [b - a for a, b in zip(el, el[1:])]
        t = statistics.median(steps[len(steps)//2:])
        best = t if best is None else min(best, t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", help="a calibrated profile (default: calibrate now)")
    parser.add_argument("--jsonl", help="write one JSON record per point here")
    args = parser.parse_args()
    profile = args.profile
    if profile is None:
        profile = str(Path(tempfile.mkdtemp()) / "calibrated.toml")
        subprocess.run([B, "calibrate", "-o", profile], check=True)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    records, errors = [], []
    for mesh, strategy, p, sched, m in CASES:
        flags = ["--mesh", mesh, "--strategy", strategy, "--accum", str(m)]
        if sched:
            flags += ["--pipeline", str(p), "--pipeline-schedule", sched]
        sim = subprocess.run([B, "simulate", *MODEL, *flags, "--hardware", profile, "--json"], capture_output=True, text=True, check=True)
        d = json.loads(sim.stdout)
        predicted = find(d, "step_time_s")
        split = ["--pipeline-split", ",".join(map(str, counts(find(d, "per_stage"), p)))] if sched else []
        measured = measure(flags + split)
        error = predicted / measured - 1
        errors.append(error)
        records.append({"mesh": mesh, "strategy": strategy, "stages": p, "schedule": sched, "micro_batches": m,
                        "split": split[1] if split else None, "predicted_s": predicted, "measured_s": measured,
                        "error": error, "cpu": cpu, "hidden": HIDDEN})
        print(f"{mesh:6} {strategy:9} pp{p} {sched or '-':12} m={m} {' '.join(split):24}: measured {measured*1e3:8.1f} ms"
              f"  predicted {predicted*1e3:8.1f} ms  error {error*100:+.1f}%", flush=True)
    print(f"{len(errors)} points: mean |error| {100*sum(abs(e) for e in errors)/len(errors):.1f}%, worst {100*max(errors, key=abs):+.1f}%")
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
