"""The losses of a mesh run on the GPU (devices sharing it) against the same run on the CPU backend.

For each --meshes entry, runs `optimusc run MODEL --mesh M --steps N --json` with --backend cpu and
--backend cuda (f32, dropout off, the same seed and sizes) and compares every step's loss and gradient
norm; prints one JSON line per mesh and exits 1 when any differ by more than --tol (relative, at least
1 in the denominator). A measurement script for the GPU machine (scripts/gpu_mesh_check.sh).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def run(optimusc, model, mesh, backend, steps, sets):
    command = [optimusc, "run", model, "--mesh", mesh, "--backend", backend, "--steps", str(steps), "--json"]
    for item in sets:
        command += ["--set", item]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()[-400:]}")
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return records, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--optimusc", default=".gpu/optimusc")
    parser.add_argument("--model", default="examples/gpt2.opt")
    parser.add_argument("--meshes", default="2x2,2x2x2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--set", action="append", default=["batch=4", "seq=128", "pdrop=0.0"])
    parser.add_argument("--tol", type=float, default=1e-4)
    args = parser.parse_args()
    worst = 0.0
    for mesh in args.meshes.split(","):
        cpu, cpu_s = run(args.optimusc, args.model, mesh, "cpu", args.steps, args.set)
        gpu, gpu_s = run(args.optimusc, args.model, mesh, "cuda", args.steps, args.set)
        diffs = [abs(c[k] - g[k]) / max(1.0, abs(c[k])) for c, g in zip(cpu, gpu) for k in ("loss", "grad_norm")]
        ok = len(cpu) == len(gpu) == args.steps and max(diffs) <= args.tol
        worst = max(worst, max(diffs) if ok else float("inf"))
        print(json.dumps({"model": args.model, "mesh": mesh, "sets": args.set, "precision": "f32",
                          "cpu_losses": [r["loss"] for r in cpu], "cuda_losses": [r["loss"] for r in gpu],
                          "max_relative_difference": max(diffs), "tol": args.tol, "agree": ok,
                          "cpu_wall_s": round(cpu_s, 2), "cuda_wall_s": round(gpu_s, 2)}))
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
