#!/usr/bin/env python3
"""Compare examples/llama.opt run by `optimusc run` with Hugging Face's LlamaForCausalLM in float64.

Both sides start from the same weights (LlamaForCausalLM's initialisation, with the RMSNorm weights
perturbed so that a norm weight loaded or updated in the wrong place would show), read the same tokens
and apply the same optimizer. The reference runs in float64; optimusc in float32. For every
(config, optimizer, mesh) the script checks, with tol = 1e-4,

  * every step's loss:                     |loss_optimus - loss_torch| / |loss_torch|   <= tol
  * every parameter after the last step:   max|w_optimus - w_torch| / max|w_torch|     <= tol (per tensor)

  configs     gqa     heads 8, kv_heads 4  (each key/value head shared by 2 query heads)
              gqa2    heads 8, kv_heads 2 on 2x2 and 1x1 only (4 query heads per key/value head)
              mha     heads 4, kv_heads 4  (kv_heads == heads) on 2x2, 1x1 and 1x4
              all with vocab 333 (divisible by neither 2 nor 4: optimusc pads the head and the embedding),
              hidden 64, ffn 96, 2 layers, seq 16, batch 4, rope_theta 10000, rms_norm_eps 1e-5, untied head
  optimizers  SGD    lr 0.1, momentum 0.9, weight_decay 0.01  (torch.optim.SGD)
              AdamW  lr 1e-2, betas (0.9, 0.999), eps 1e-4, weight_decay 0.1  (torch.optim.AdamW; eps as in
                     scripts/hf_compare.py, which explains why 1e-8 is ill-conditioned in float32)
  meshes      none 1x1, optimus 2x2, optimus 4x4, megatron 1x4 (each config on those its head counts divide)
  files       the initial weights are written with save_pretrained (`model.`-prefixed names, lm_head.weight,
              [out, in] linear weights): once as one model.safetensors, and once sharded by a small
              max_shard_size into several files with model.safetensors.index.json; the runs alternate between
              the two, and a separate check loads both into optimusc and requires identical losses.

Data rule (the one `optimusc run --data` implements): step k, sequence r reads the seq + 1 tokens starting at
o = (k * batch + r) * seq, wrapping at the end of the token file; input = the first seq, target = the last
seq. The loss is the mean cross-entropy over all batch * seq targets (F.cross_entropy on the logits; the
model's own labels= would shift them again).

Usage (scripts/hf_compare.sh --llama sets up the venv and builds optimusc first):
    python scripts/hf_llama_compare.py --optimusc target/release/optimusc [--steps 3] [--keep DIR]
Exit status: 0 when everything agrees, 1 on any mismatch or failed run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from hf_common import ALL_MESHES, OPTIMIZERS, Optimizer, rel, run_records, set_flags
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "examples" / "llama.opt"

VOCAB, CONTEXT, SEQ, BATCH, LAYERS, HIDDEN, FFN = 333, 32, 16, 4, 2, 64, 96
THETA, EPS = 10000.0, 1e-5

# name -> (heads, kv_heads, meshes)
CONFIGS = {
    "gqa": (8, 4, ALL_MESHES),
    "gqa2": (8, 2, [("none", "1x1"), ("optimus", "2x2")]),
    "mha": (4, 4, [("none", "1x1"), ("optimus", "2x2"), ("megatron", "1x4")]),
}




@dataclass
class Result:
    config: str
    optimizer: str
    strategy: str
    mesh: str
    files: str
    seconds: float = 0.0
    error: str | None = None
    loss_diff: float = 0.0
    weight_diff: float = 0.0
    worst: str = "-"
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems


def make_model(seed: int, heads: int, kv_heads: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=EPS,
        rope_theta=THETA,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.train()
    return model


def save_init(model: LlamaForCausalLM, workdir: Path, tag: str) -> dict[str, Path]:
    single = workdir / f"{tag}_single"
    sharded = workdir / f"{tag}_sharded"
    model.save_pretrained(str(single), safe_serialization=True)
    model.save_pretrained(str(sharded), safe_serialization=True, max_shard_size="60KB")
    assert (single / "model.safetensors").is_file(), "one file expected"
    index = sharded / "model.safetensors.index.json"
    assert index.is_file(), "a sharded save expected"
    n_files = len(set(json.loads(index.read_text())["weight_map"].values()))
    assert n_files >= 3, f"only {n_files} shards"
    return {"single": single / "model.safetensors", f"{n_files} shards": sharded}


def make_tokens(seed: int, workdir: Path) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = 3 * BATCH * SEQ + 37
    tokens = rng.integers(0, VOCAB, size=n, dtype=np.uint16)
    tokens[[5, 77, n - 1]] = VOCAB - 1
    tokens.astype("<u2").tofile(workdir / "tokens.bin")
    return tokens


def batch_for_step(tokens: np.ndarray, step: int):
    n = len(tokens)
    rows = [tokens[((step * BATCH + r) * SEQ + np.arange(SEQ + 1)) % n].astype(np.int64) for r in range(BATCH)]
    window = torch.from_numpy(np.stack(rows))
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def train_torch(seed, heads, kv_heads, tokens, opt: Optimizer, steps: int):
    """The float64 reference: per-step losses and the final state dict as numpy float64."""
    model = make_model(seed, heads, kv_heads).to(torch.float64)
    optimizer = opt.torch(model.parameters())
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = batch_for_step(tokens, step)
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def config_flags(heads: int, kv_heads: int) -> list[str]:
    values = {
        "vocab": VOCAB, "context": CONTEXT, "seq": SEQ, "batch": BATCH, "layers": LAYERS, "heads": heads,
        "kv_heads": kv_heads, "hidden": HIDDEN, "ffn": FFN, "rope_theta": THETA, "eps": EPS,
    }  # fmt: skip
    return set_flags(values)


def run_optimusc(args, heads, kv_heads, strategy, mesh, opt, init: Path, workdir: Path, tag: str):
    out = workdir / f"out_{tag}.safetensors"
    cmd = [
        str(args.optimusc), "run", str(MODEL), "--mesh", mesh, "--strategy", strategy,
        *config_flags(heads, kv_heads), "--steps", str(args.steps),
        "--data", str(workdir / "tokens.bin"), "--data-dtype", "u16",
        "--weights", str(init), "--save-weights", str(out), "--json", *opt.flags(),
    ]  # fmt: skip
    return run_records(args, cmd, out)


def compare(result: Result, losses, weights, ref_losses, ref_weights, tol):
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        d = abs(a - b) / abs(b)
        result.loss_diff = max(result.loss_diff, d)
        if not d <= tol:
            result.problems.append(f"step {step} loss {a:.7f} vs torch float64 {b:.7f}: rel diff {d:.2e}")
    if set(weights) != set(ref_weights):
        result.problems.append(f"tensor names differ: missing {sorted(set(ref_weights) - set(weights))}, "
                               f"extra {sorted(set(weights) - set(ref_weights))}")  # fmt: skip
    for name in sorted(set(weights) & set(ref_weights)):
        a, b = weights[name], ref_weights[name]
        if a.shape != b.shape:
            result.problems.append(f"{name}: saved {list(a.shape)}, torch {list(b.shape)}")
            continue
        d = rel(a, b)
        if d > result.weight_diff:
            result.weight_diff, result.worst = d, name
        if not d <= tol:
            result.problems.append(f"{name}: max|a-b|/max|b| = {d:.2e}")


def check_files_agree(args, heads, kv_heads, inits: dict[str, Path], workdir: Path) -> str | None:
    """One-file and sharded initial weights give identical losses on 2x2 (an error text otherwise)."""
    opt = OPTIMIZERS["sgd"]
    got = {}
    for style, init in inits.items():
        losses, _, _ = run_optimusc(args, heads, kv_heads, "optimus", "2x2", opt, init, workdir, f"files_{len(got)}")
        got[style] = losses
    values = list(got.values())
    if values[0] != values[1]:
        return f"losses differ between the files: {got}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimusc", type=Path, default=REPO / "target" / "release" / "optimusc")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of %(default)s")
    parser.add_argument("--optimizers", default="sgd,adamw")
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--run-timeout", type=float, default=600.0)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    if not args.optimusc.exists():
        print(f"error: {args.optimusc} does not exist (cargo build --release)", file=sys.stderr)
        return 1
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="hf_llama_"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    problems: list[str] = []
    try:
        print(f"model: {MODEL.relative_to(REPO)} with vocab={VOCAB} hidden={HIDDEN} ffn={FFN} layers={LAYERS} "
              f"seq={SEQ} batch={BATCH} rope_theta={THETA:g}; {args.steps} steps; reference LlamaForCausalLM "
              f"float64, torch {torch.__version__}")  # fmt: skip
        tokens = make_tokens(args.seed, workdir)
        run_index = 0
        for cname in [c for c in args.configs.split(",") if c]:
            heads, kv_heads, meshes = CONFIGS[cname]
            model = make_model(args.seed, heads, kv_heads)
            n_params = sum(p.numel() for p in model.parameters())
            inits = save_init(model, workdir, cname)
            print(f"\n== {cname}: heads {heads}, kv_heads {kv_heads}, {n_params} parameters; files: {', '.join(inits)}")
            error = check_files_agree(args, heads, kv_heads, inits, workdir)
            print(f"   one file vs shards on optimus 2x2: {'identical losses' if error is None else error}")
            if error is not None:
                problems.append(f"{cname}: {error}")
            for oname in [o for o in args.optimizers.split(",") if o]:
                opt = OPTIMIZERS[oname]
                ref_losses, ref_weights = train_torch(args.seed, heads, kv_heads, tokens, opt, args.steps)
                print(f"   {oname}: torch float64 losses " + " ".join(f"{x:.7f}" for x in ref_losses))
                for strategy, mesh in meshes:
                    style = list(inits)[run_index % len(inits)]
                    run_index += 1
                    result = Result(cname, oname, strategy, mesh, style)
                    try:
                        losses, weights, result.seconds = run_optimusc(
                            args, heads, kv_heads, strategy, mesh, opt, inits[style], workdir, f"{cname}_{oname}_{mesh}"
                        )
                        compare(result, losses, weights, ref_losses, ref_weights, args.tol)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        result.error = str(e)
                    results.append(result)
                    status = "ok" if result.ok else ("RUN FAILED" if result.error else "MISMATCH")
                    print(f"   {oname:<6} {strategy:<8} {mesh:<4} ({style}): {status}  loss {result.loss_diff:.1e}  "
                          f"weights {result.weight_diff:.1e} ({result.worst})  {result.seconds:.1f}s")  # fmt: skip
                    for line in ([result.error] if result.error else []) + result.problems[:8]:
                        print("      " + line.replace("\n", "\n      "))
        failed = [r for r in results if not r.ok]
        print(f"\n(tolerance {args.tol:g}: loss |a-b|/|b| per step, weights max|a-b|/max|b| per tensor, "
              "b = LlamaForCausalLM in float64)")  # fmt: skip
        ok = not failed and not problems
        print(("PASS" if ok else "FAIL") + f": {len(results) - len(failed)} of {len(results)} runs agree"
              + (f"; {len(problems)} file checks failed" if problems else ""))  # fmt: skip
        print(f"hf_llama_compare: {len(results) - len(failed)} passed, {len(failed) + len(problems)} failed")
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
