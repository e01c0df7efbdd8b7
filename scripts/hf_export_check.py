#!/usr/bin/env python3
"""Checks that what `optimusc run --save-weights DIR/` and `optimusc export CHECKPOINT -o DIR/` write is what
`from_pretrained` opens, with no
hand-written config: for GPT-2, Llama with grouped-query and full attention, and BERT, on
several meshes, it trains a few steps, saves, loads the folder with transformers' Auto classes in
float64, and requires

- no missing, unexpected or mismatched keys, and the architecture the model is;
- the loaded model's loss on a batch equal to `optimusc run --mode infer --weights DIR` on that batch
  (float32) within 1e-5 relative: the config's every number (widths, heads, key/value heads, epsilons,
  rotary base, activation, tying) is the one the model computed with.

Usage: hf_export_check.py --optimusc PATH
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

REPO = Path(__file__).resolve().parent.parent
VOCAB, SEQ, BATCH = 101, 8, 4
SMALL = {"layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "vocab": VOCAB, "seq": SEQ, "context": 16, "batch": BATCH}
CASES = [
    # (label, model file, extra config values, mesh, strategy, Auto class, architecture)
    ("gpt2", "gpt2.opt", {"pdrop": 0}, "2x2", "optimus", AutoModelForCausalLM, "GPT2LMHeadModel"),
    ("llama-gqa", "llama.opt", {"kv_heads": 2}, "1x2", "megatron", AutoModelForCausalLM, "LlamaForCausalLM"),
    # Epsilons far from every default, so that a config that left them out would change the loss.
    ("llama-mha", "llama.opt", {"kv_heads": 4, "rope_theta": 10000.0, "eps": 0.1}, "1x1", "none",
     AutoModelForCausalLM, "LlamaForCausalLM"),
    ("bert", "bert.opt", {"pdrop": 0, "types": 2, "eps": 0.05}, "2x2", "optimus", AutoModelForMaskedLM, "BertForMaskedLM"),
]
FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def sets(values):
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]


def optimusc(binary, args):
    result = subprocess.run([binary, *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"optimusc {' '.join(args)} failed:\n{result.stderr}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def data_files(work: Path, is_bert: bool):
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, VOCAB, size=4096, dtype=np.uint16)
    files = {"data": work / "tokens.u16"}
    tokens.tofile(files["data"])
    if is_bert:
        # Every position labelled with its own token; token types half 0, half 1.
        files["labels"] = work / "labels.u16"
        tokens.tofile(files["labels"])
        files["segments"] = work / "segments.u16"
        (np.arange(4096) % SEQ >= SEQ // 2).astype(np.uint16).tofile(files["segments"])
    return tokens, files


def data_flags(files, is_bert):
    flags = ["--data", str(files["data"])]
    if is_bert:
        flags += ["--objective", "mlm", "--labels", str(files["labels"]), "--segments", str(files["segments"])]
    return flags


def reference_loss(model, tokens, is_bert):
    """Batch 0 as optimusc reads it: sequence r at offset r*SEQ; causal targets the next token."""
    rows = [tokens[r * SEQ:r * SEQ + SEQ + 1].astype(np.int64) for r in range(BATCH)]
    x = torch.tensor(np.stack([row[:SEQ] for row in rows]))
    with torch.no_grad():
        if is_bert:
            types = torch.tensor(np.stack([(np.arange(SEQ) >= SEQ // 2).astype(np.int64)] * BATCH))
            logits = model(input_ids=x, token_type_ids=types).logits
            targets = x
        else:
            logits = model(input_ids=x).logits
            targets = torch.tensor(np.stack([row[1:] for row in rows]))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1)).item()


def check_case(binary, work: Path, case):
    label, model_file, extra, mesh, strategy, auto, architecture = case
    is_bert = model_file == "bert.opt"
    tokens, files = data_files(work, is_bert)
    model = str(REPO / "examples" / model_file)
    config = sets({**SMALL, **extra})
    out = work / f"{label}-export"
    checkpoints = work / f"{label}-checkpoints"
    optimusc(binary, ["run", model, *config, "--mesh", mesh, "--strategy", strategy, "--steps", "3", "--lr", "0.01",
                      *data_flags(files, is_bert), "--save-weights", f"{out}/", "--json",
                      "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "3"])
    records = optimusc(binary, ["run", model, *config, "--mode", "infer", "--weights", str(out), "--steps", "1",
                                *data_flags(files, is_bert), "--json"])
    ours = next(r["loss"] for r in records if "loss" in r)
    loaded, info = auto.from_pretrained(out, output_loading_info=True, torch_dtype=torch.float64)
    problems = {k: v for k, v in info.items() if v}
    check(not problems, f"{label}: from_pretrained loads every key and no other {problems or ''}")
    check(type(loaded).__name__ == architecture, f"{label}: {type(loaded).__name__}")
    loaded.eval()
    theirs = reference_loss(loaded, tokens, is_bert)
    rel = abs(ours - theirs) / abs(theirs)
    check(rel <= 1e-5, f"{label} ({strategy} {mesh}): loss {ours:.7f} ours, {theirs:.7f} from_pretrained float64 "
                       f"(relative {rel:.1e})")
    # `optimusc export` of the last checkpoint into a folder: the same model, opened the same way.
    exported = work / f"{label}-exported"
    subprocess.run([binary, "export", str(checkpoints), "-o", f"{exported}/"], check=True, capture_output=True)
    again, info = auto.from_pretrained(exported, output_loading_info=True, torch_dtype=torch.float64)
    check(not any(info.values()), f"{label}: export DIR/ loads every key and no other")
    again.eval()
    check(reference_loss(again, tokens, is_bert) == theirs, f"{label}: export DIR/ computes what --save-weights DIR/ does")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimusc", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        for case in CASES:
            check_case(args.optimusc, Path(work), case)
    print(f"{'FAILED' if FAILURES else 'passed'}: --save-weights DIR/ opens with from_pretrained")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
