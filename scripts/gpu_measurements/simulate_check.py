#!/usr/bin/env python3
"""Predicted against measured GPU steps: `optimusc simulate --hardware PROFILE` (a profile written by
`optimusc calibrate --backend cuda` on this GPU) beside `optimusc run --backend cuda` on models and
meshes the calibration did not run: GPT-2 small in bf16 and f32 on 1x1, GPT-2 small in bf16 on meshes
whose devices share the GPU (optimus 2x2, with and without --overlap, optimus 2x2x2, megatron 1x4; 2x2
in f32 too), a 24-layer hidden-1024 GPT-2, TinyLlama at sequence 2048, an 8-layer hidden-1536 Llama with
grouped-query attention and BERT base on 1x1.

Usage: python3 scripts/gpu_measurements/simulate_check.py --optimusc PATH --profile GPU.toml
                                                          [--jsonl FILE] [--steps N] [--warmup W]
                                                          [--skip K,K...]

The measured step is the median of the differences of `run --json`'s `elapsed_s` after --warmup steps.
Prints a line per point and the mean and worst absolute error; --jsonl appends one JSON record per
point (raw results: system, model, mesh, precision, measured and predicted step, GPU, driver, date).
Runs on a GPU machine; not part of the test suite.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from steps_ab import step_time  # noqa: E402  (scripts/steps_ab.py: the median step of a run)

GPT2_SMALL = {"layers": 12, "hidden": 768, "heads": 12, "vocab": 50257, "seq": 1024, "context": 1024,
              "batch": 8, "pdrop": "0.0"}
GPT2_WIDE = {"layers": 24, "hidden": 1024, "heads": 16, "vocab": 50257, "seq": 1024, "context": 1024,
             "batch": 4, "pdrop": "0.0"}
LLAMA_MID = {"layers": 8, "hidden": 1536, "heads": 24, "kv_heads": 8, "ffn": 4096, "vocab": 32000, "seq": 1024,
             "context": 1024, "batch": 4}
BERT_BASE = {"layers": 12, "hidden": 768, "heads": 12, "vocab": 30522, "seq": 512, "context": 512, "batch": 8}

# (label, model file, overrides, strategy, mesh, precision, overlap)
POINTS = [
    ("gpt2-small bf16 1x1", "examples/gpt2.opt", GPT2_SMALL, "none", "1x1", "bf16", False),
    ("gpt2-small f32 1x1", "examples/gpt2.opt", GPT2_SMALL, "none", "1x1", "f32", False),
    ("gpt2-small bf16 optimus 2x2", "examples/gpt2.opt", GPT2_SMALL, "optimus", "2x2", "bf16", False),
    ("gpt2-small bf16 optimus 2x2 overlap", "examples/gpt2.opt", GPT2_SMALL, "optimus", "2x2", "bf16", True),
    ("gpt2-small bf16 optimus 2x2x2", "examples/gpt2.opt", GPT2_SMALL, "optimus", "2x2x2", "bf16", False),
    ("gpt2-small bf16 megatron 1x4", "examples/gpt2.opt", GPT2_SMALL, "megatron", "1x4", "bf16", False),
    ("gpt2-24x1024 bf16 1x1", "examples/gpt2.opt", GPT2_WIDE, "none", "1x1", "bf16", False),
    ("tinyllama seq2048 bf16 1x1", "examples/tinyllama.opt", {"batch": 4}, "none", "1x1", "bf16", False),
    ("llama-8x1536 gqa bf16 1x1", "examples/llama.opt", LLAMA_MID, "none", "1x1", "bf16", False),
    ("bert-12x768 seq512 bf16 1x1", "examples/bert.opt", BERT_BASE, "none", "1x1", "bf16", False),
    ("gpt2-small f32 optimus 2x2", "examples/gpt2.opt", GPT2_SMALL, "optimus", "2x2", "f32", False),
]


def target(point):
    _, model, sets, strategy, mesh, precision, overlap = point
    args = [model, "--mesh", mesh, "--strategy", strategy, "--precision", precision]
    for name, value in sets.items():
        args += ["--set", f"{name}={value}"]
    return args + (["--overlap"] if overlap else [])


def measured_step(optimusc, point, steps, warmup):
    return step_time(optimusc, [*target(point), "--backend", "cuda", "--lr", "1e-4"], steps, warmup)[0]


def predicted_step(optimusc, point, profile):
    command = [optimusc, "simulate", *target(point), "--hardware", profile, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout)["step_time_s"]


def gpu_and_driver():
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, check=False)
    first = (done.stdout.strip().splitlines() or ["unknown, unknown"])[0]
    name, _, driver = first.partition(",")
    return name.strip(), driver.strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimusc", required=True)
    parser.add_argument("--profile", required=True, help="a profile from `optimusc calibrate --backend cuda`")
    parser.add_argument("--jsonl", help="append one JSON record per point here")
    parser.add_argument("--steps", type=int, default=6, help="timed steps a point (default 6)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--skip", default="", help="comma-separated point numbers (from 1) to leave out")
    args = parser.parse_args()
    skipped = {int(k) for k in args.skip.split(",") if k.strip()}
    points = [p for k, p in enumerate(POINTS, 1) if k not in skipped]
    gpu, driver = gpu_and_driver()
    errors = []
    for point in points:
        label, model, sets, strategy, mesh, precision, overlap = point
        try:
            predicted = predicted_step(args.optimusc, point, args.profile)
            measured = measured_step(args.optimusc, point, args.steps, args.warmup)
        except RuntimeError as e:
            print(f"{label}: failed: {e}", flush=True)
            continue
        error = predicted / measured - 1.0
        errors.append(abs(error))
        print(f"{label:38} predicted {predicted * 1e3:9.2f} ms  measured {measured * 1e3:9.2f} ms  "
              f"error {error * 100:+6.1f}%", flush=True)
        if args.jsonl:
            record = {"system": "optimusc simulate vs run", "point": label, "model": model, "sets": sets,
                      "strategy": strategy, "mesh": mesh, "precision": precision, "overlap": overlap,
                      "predicted_step_s": predicted, "measured_step_s": measured, "error": error,
                      "gpu": gpu, "driver": driver, "date": datetime.date.today().isoformat()}
            with open(args.jsonl, "a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")
    if errors:
        print(f"mean |error| {statistics.mean(errors) * 100:.1f}%, worst {max(errors) * 100:.1f}% "
              f"over {len(errors)} of {len(points)} points")
    return 0 if len(errors) == len(points) else 1


if __name__ == "__main__":
    sys.exit(main())
