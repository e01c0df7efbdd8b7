"""What scripts/hf_llama_compare.py and scripts/hf_bert_compare.py share: the optimizer settings applied
identically on both sides, the meshes, `--set` flags, running `optimusc run --json` and reading its records
and saved weights, and the relative difference of two tensors."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file as load_numpy

ALL_MESHES = [("none", "1x1"), ("optimus", "2x2"), ("optimus", "4x4"), ("megatron", "1x4"), ("tesseract", "2x2x2"), ("3d", "2x2x2")]


@dataclass
class Optimizer:
    """SGD or AdamW, as torch.optim builds it and as optimusc's flags ask for it."""

    name: str
    lr: float
    weight_decay: float
    momentum: float = 0.0
    eps: float = 1e-4

    def torch(self, params):
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, betas=(0.9, 0.999), eps=self.eps, weight_decay=self.weight_decay)

    def flags(self) -> list[str]:
        flags = ["--optimizer", self.name, "--lr", repr(self.lr), "--weight-decay", repr(self.weight_decay)]
        if self.name == "sgd":
            return flags + ["--momentum", repr(self.momentum)]
        return flags + ["--beta1", "0.9", "--beta2", "0.999", "--eps", repr(self.eps)]


# AdamW's eps is 1e-4 on both sides, as in scripts/hf_compare.py, which explains why 1e-8 is ill-conditioned
# in float32.
OPTIMIZERS = {
    "sgd": Optimizer("sgd", lr=0.1, weight_decay=0.01, momentum=0.9),
    "adamw": Optimizer("adamw", lr=1e-2, weight_decay=0.1),
}


def set_flags(values: dict) -> list[str]:
    """`--set NAME=VALUE` for every config value."""
    flags = []
    for name, value in values.items():
        flags += ["--set", f"{name}={value}"]
    return flags


def run_records(args, cmd: list[str], out: Path):
    """Runs `optimusc run ... --json --save-weights out`; returns (per-step losses, saved weights, seconds).
    `args` carries steps, run_timeout and verbose."""
    if args.verbose:
        print("  $ " + " ".join(cmd))
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"optimusc exited {proc.returncode}:\n{proc.stderr.strip()}\n{proc.stdout.strip()}")
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    records = [r for r in records if "loss" in r]
    if [r.get("step") for r in records] != list(range(args.steps)):
        raise RuntimeError(f"expected steps 0..{args.steps - 1}, got:\n{proc.stdout}")
    return [r["loss"] for r in records], load_numpy(str(out)), seconds


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| (b the reference); max |a - b| when b is all zeros."""
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    diff = float(np.max(np.abs(a.astype(np.float64) - b))) if b.size else 0.0
    return diff / scale if scale > 0 else diff
