#!/usr/bin/env python3
"""Compare examples/gpt2.opt run by `optimusc run` with Hugging Face's GPT2LMHeadModel.

Both sides start from the same weights, read the same tokens and apply the same
optimizer; the script computes both sides and checks that

  * every step's loss agrees:            |loss_optimus - loss_torch| / |loss_torch|   <= tol
  * every parameter agrees after N steps: max|w_optimus - w_torch| / max|w_torch|     <= tol

(per tensor), and the validation loss after the last update (mean of 2 batches
of a second token file, eval mode), and every step's gradient norm before clipping
(the `grad_norm` of optimusc's records against the global L2 norm of torch's
gradients, which clip_grad_norm_ returns), with tol = 1e-4, for every (optimizer, mesh) pair:

  optimizers  SGD    lr 0.1,  momentum 0.9, weight_decay 0.01  (torch.optim.SGD)
              AdamW  lr 1e-2, betas (0.9, 0.999), weight_decay 0.1  (torch.optim.AdamW)
              AdamW  as above, with Hugging Face's cosine schedule: warm-up 1 step, min_lr 1e-3
                     (get_cosine_with_min_lr_schedule_with_warmup; optimusc --lr-schedule cosine)
              AdamW  as above, with the linear schedule (warm-up 1, min_lr 1e-3; a LambdaLR of
                     min_lr + (lr - min_lr)(S - k)/(S - W), HF's linear schedule with a floor)
              AdamW  with clip_grad_norm_(0.05) (small enough that it clips every step)
              SGD    with 2 micro-batches per update (--accum 2; the torch side backpropagates
                     loss / 2 of each micro-batch, so the gradient is their mean)
              AdamW  with 4 micro-batches per update (--accum 4)
              AdamW  cosine + clipping at 0.05 + 4 micro-batches, all at once
  meshes      none 1x1, optimus 2x2, optimus 4x4, megatron 1x4

The model is small: 2 layers, hidden 64, 4 heads, vocabulary 333 (divisible by
neither 2 nor 4, so optimusc pads the embedding for every sharded mesh), 32
positions, batch 4 of sequences of 16, dropout 0, LayerNorm epsilon 1e-5,
gelu_new. Hugging Face's initialisation is kept for the weights; biases and
LayerNorm parameters, which it sets to 0 and 1, are then perturbed randomly so
that a bias or LayerNorm parameter that were loaded, updated or saved in the
wrong place would show.

Data rule (the one `optimusc run --data` implements): step k, sequence r reads
the seq + 1 tokens starting at o = (k * batch + r) * seq (with --accum N, micro-batch
m of step k is batch k * N + m), wrapping at the end of
the token file; input = the first seq, target = the last seq. The token file is
short enough that the last steps wrap. GPT2LMHeadModel(labels=...) would shift
the labels itself, so the torch side takes the logits and computes the mean
cross-entropy over all batch * seq targets with F.cross_entropy, which is what
optimusc reports.

The initial weights are written three times: with hub-style names
(`h.0.attn...`, causal-mask buffers and the tied `lm_head.weight` dropped, via
safetensors.torch.save_file), with `save_pretrained` (`transformer.h.0...`),
and hub-style with the causal-mask buffers `attn.bias`/`attn.masked_bias` and
`lm_head.weight` present, as in the original hub files, which optimusc must
ignore. The runs cycle through the three files, so every style is loaded.

AdamW runs with eps = 1e-4 on both sides, not PyTorch's default 1e-8. AdamW's
step lr * m / (sqrt(v) + eps) is ill-conditioned for an element whose gradient
is about eps or smaller: there the step is proportional to g / eps, so float32
rounding noise in g (about 1e-9 absolute here, from cancellation in the
backward pass; it differs between PyTorch and any other float32 program, and
between meshes) moves the weight by up to lr * noise / eps. Such elements are
common: the attention key bias has an analytically zero gradient (softmax
ignores a shift shared by all keys; both sides compute ~1e-11 of noise there),
and some tensors have hundreds of weights with |g| < 1e-6 (414 of the 12288
in h.1.attn.c_attn.weight at step 0). Measured with
this script (max|a-b|/max|b| over all tensors, all four meshes):
    eps 1e-8: 2e-3 .. 1e-2    eps 1e-6: 1.2e-4 .. 1.8e-4
    eps 1e-5: 2e-5 .. 5e-5    eps 1e-4: 6e-6 .. 8e-6
and the worst elements at 1e-8 are those with |g| ~ 1e-9 .. 1e-8, whose float32
gradient is off by ~15% from the float64 one in PyTorch itself. The error
shrinks as 1/eps, as conditioning predicts, while losses agree to ~1e-7; and at
eps 1e-8 PyTorch float32 differs from PyTorch float64 by 8e-3 too. With
eps = 1e-4 the bound lr * 1e-9 / eps = 1e-7 is far below the tolerance, and
every element of every tensor, the key bias included, is checked; elements with
|g| >> 1e-4 still take Adam's normalised steps and those below take eps-dominated
ones, so both regimes (and eps's place in the formula) are exercised.
`--adamw-eps 1e-8` runs PyTorch's default anyway (and then fails for the reason
above). Every optimizer's reference is also run in float64: optimusc must agree with it too, and
its difference to the float32 reference printed: the float32 noise floor.

Usage (scripts/hf_compare.sh sets up the venv and builds optimusc first):
    python scripts/hf_compare.py --optimusc target/release/optimusc [--steps 4] [--keep DIR]

Exit status: 0 when everything agrees, 1 on any mismatch or failed run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_with_min_lr_schedule_with_warmup
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "examples" / "gpt2.opt"

# The small model: GPT2Config name -> value. The optimusc config names follow.
VOCAB, CONTEXT, SEQ, BATCH, LAYERS, HEADS, HIDDEN = 333, 32, 16, 4, 2, 4, 64
EPS_LN = 1e-5

# (strategy, mesh) pairs to run.
MESHES = [("none", "1x1"), ("optimus", "2x2"), ("optimus", "4x4"), ("megatron", "1x4"), ("tesseract", "2x2x2"), ("3d", "2x2x2")]


@dataclass
class Optimizer:
    """One optimizer setting, applied identically on both sides."""

    name: str  # sgd | adamw
    lr: float
    weight_decay: float
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    # A learning-rate schedule (Hugging Face's cosine with warm-up and min_lr), or None for a constant rate.
    schedule: str | None = None
    warmup: int = 0
    min_lr: float = 0.0
    # torch.nn.utils.clip_grad_norm_'s max_norm (optimusc --clip-grad-norm), or None for no clipping.
    clip: float | None = None
    # Micro-batches per update (optimusc --accum).
    accum: int = 1
    # The name in the results table.
    tag: str = ""

    def torch(self, params):
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)

    @property
    def label(self) -> str:
        """The name in the results table."""
        return self.tag or (f"{self.name}-{self.schedule}" if self.schedule else self.name)

    def scheduler(self, optimizer, steps: int):
        """The torch scheduler of this setting (None for a constant rate); step it after every update."""
        if self.schedule is None:
            return None
        if self.schedule == "cosine":
            return get_cosine_with_min_lr_schedule_with_warmup(optimizer, self.warmup, steps, min_lr=self.min_lr)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.linear_factor(steps))

    def linear_factor(self, steps: int):
        """The linear schedule as a LambdaLR factor of update k: k/W in the warm-up, then a straight line
        from 1 down to min_lr/lr at update S (Hugging Face's linear schedule, with a floor)."""
        floor, warmup = self.min_lr / self.lr, self.warmup

        def factor(k: int) -> float:
            if k < warmup:
                return k / max(1, warmup)
            return floor + (1 - floor) * (steps - k) / max(1, steps - warmup)

        return factor

    def flags(self) -> list[str]:
        flags = ["--optimizer", self.name, "--lr", repr(self.lr), "--weight-decay", repr(self.weight_decay)]
        if self.schedule is not None:
            flags += ["--lr-schedule", self.schedule, "--warmup-steps", str(self.warmup), "--min-lr", repr(self.min_lr)]
        if self.clip is not None:
            flags += ["--clip-grad-norm", repr(self.clip)]
        if self.accum > 1:
            flags += ["--accum", str(self.accum)]
        if self.name == "sgd":
            flags += ["--momentum", repr(self.momentum)]
        else:
            flags += ["--beta1", repr(self.betas[0]), "--beta2", repr(self.betas[1]), "--eps", repr(self.eps)]
        return flags

    def describe(self) -> str:
        extra = f", {self.schedule} schedule (warmup {self.warmup}, min_lr {self.min_lr})" if self.schedule else ""
        extra += f", clip_grad_norm_ {self.clip}" if self.clip is not None else ""
        extra += f", {self.accum} micro-batches per update" if self.accum > 1 else ""
        if self.name == "sgd":
            return f"SGD lr={self.lr} momentum={self.momentum} weight_decay={self.weight_decay}{extra}"
        return f"AdamW lr={self.lr} betas={self.betas} eps={self.eps:g} weight_decay={self.weight_decay}{extra}"


@dataclass
class Result:
    """The comparison of one optimusc run with the torch reference."""

    optimizer: str
    strategy: str
    mesh: str
    init_file: str
    seconds: float = 0.0
    error: str | None = None
    loss_diffs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    norm_diffs: list[float] = field(default_factory=list)
    weight_diffs: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems


# ---------------------------------------------------------------------------
# The reference side: Hugging Face GPT-2 in PyTorch.


def make_model(seed: int) -> GPT2LMHeadModel:
    """A float32 GPT2LMHeadModel with HF's initialisation and perturbed biases / LayerNorm parameters."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=CONTEXT,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=EPS_LN,
        tie_word_embeddings=True,
        bos_token_id=VOCAB - 1,  # the defaults (50256) lie outside this vocabulary; unused here
        eos_token_id=VOCAB - 1,
    )
    # The plain attention (matmul, mask, softmax, matmul): the textbook definition.
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.add_(0.02 * torch.randn_like(p))
            elif ".ln_" in name and name.endswith(".weight"):
                p.add_(0.1 * torch.randn_like(p))
    assert model.lm_head.weight is model.transformer.wte.weight, "the LM head must be tied to wte"
    model.train()  # dropout is 0, so train and eval mode compute the same
    return model


def parameters(model: GPT2LMHeadModel) -> dict[str, torch.Tensor]:
    """Every distinct parameter under its `transformer.`-prefixed checkpoint name (lm_head is wte)."""
    return {name: p for name, p in model.named_parameters() if name.startswith("transformer.")}


def save_init_files(model: GPT2LMHeadModel, workdir: Path) -> dict[str, Path]:
    """The initial weights in three key styles; returns {style: path}."""
    # Hub style: bare names, no causal-mask buffers, no lm_head.weight (tied).
    hub = {}
    for name, t in model.state_dict().items():
        if name.startswith("lm_head.") or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        hub[name.removeprefix("transformer.")] = t.detach().contiguous().clone()
    hub_path = workdir / "init_hub.safetensors"
    save_file(hub, str(hub_path), metadata={"format": "pt"})

    # save_pretrained style: `transformer.` names, whatever transformers decides to write.
    pretrained_dir = workdir / "init_pretrained"
    model.save_pretrained(str(pretrained_dir), safe_serialization=True)
    pretrained_path = pretrained_dir / "model.safetensors"

    # Hub style as the original hub files (older transformers) have it: bare names plus each layer's
    # causal-mask buffers `attn.bias` [1, 1, n_positions, n_positions] and `attn.masked_bias` [], and
    # a copy of the tied `lm_head.weight`; optimusc must ignore all three.
    full = dict(hub)
    for i in range(LAYERS):
        full[f"h.{i}.attn.bias"] = torch.tril(torch.ones(CONTEXT, CONTEXT)).view(1, 1, CONTEXT, CONTEXT)
        full[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    full["lm_head.weight"] = hub["wte.weight"].clone()
    full_path = workdir / "init_hub_full.safetensors"
    save_file(full, str(full_path), metadata={"format": "pt"})

    # Every file must hold the same parameters, or the styles would test different weights.
    files = {"hub": hub_path, "pretrained": pretrained_path, "hub+buffers": full_path}
    loaded = {style: load_numpy(str(path)) for style, path in files.items()}
    for name, p in parameters(model).items():
        ref = p.detach().numpy()
        for style, tensors in loaded.items():
            key = name if name in tensors else name.removeprefix("transformer.")
            assert np.array_equal(tensors[key], ref), f"{style} file: {key} differs"
    return files


def make_tokens(seed: int, workdir: Path) -> np.ndarray:
    """A uint16 token file; the last steps wrap around its end."""
    rng = np.random.default_rng(seed)
    # Three steps' worth plus a bit: step 3 reads past the end and wraps.
    n = 3 * BATCH * SEQ + 37
    tokens = rng.integers(0, VOCAB, size=n, dtype=np.uint16)
    tokens[[5, 77, n - 1]] = VOCAB - 1  # the last real row of the (padded) embedding
    tokens[[6, 100]] = 0
    tokens.astype("<u2").tofile(workdir / "tokens.bin")
    return tokens


# Validation: a second token file, and how many of its batches each evaluation averages.
VAL_BATCHES = 2


def make_val_tokens(seed: int, workdir: Path) -> np.ndarray:
    """The validation token file (another seed); its second batch wraps around its end."""
    rng = np.random.default_rng(seed + 1)
    tokens = rng.integers(0, VOCAB, size=BATCH * SEQ + 29, dtype=np.uint16)
    tokens.astype("<u2").tofile(workdir / "val.bin")
    return tokens


def validation_loss(model, val_tokens: np.ndarray) -> float:
    """The mean loss of validation batches 0..VAL_BATCHES-1, in eval mode (dropout off), no update."""
    model.eval()
    with torch.no_grad():
        total = 0.0
        for v in range(VAL_BATCHES):
            inputs, targets = batch_for_step(val_tokens, v)
            logits = model(input_ids=inputs).logits
            total += F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).item()
    model.train()
    return total / VAL_BATCHES


def batch_for_step(tokens: np.ndarray, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of one step, each [batch, seq] int64, by the shared data rule."""
    n = len(tokens)
    rows = []
    for r in range(BATCH):
        o = (step * BATCH + r) * SEQ
        rows.append(tokens[(o + np.arange(SEQ + 1)) % n].astype(np.int64))
    window = torch.from_numpy(np.stack(rows))
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def train_torch(seed: int, tokens: np.ndarray, opt: Optimizer, steps: int, val_tokens: np.ndarray, dtype=torch.float32):
    """Runs the reference; returns (per-step losses, final parameters as numpy by prefixed name, the
    validation loss after the last update, per-step gradient norms before clipping).

    dtype float64 gives the same initial values (float32 ones, widened) computed in float64.
    """
    model = make_model(seed).to(dtype)
    optimizer = opt.torch(model.parameters())  # tied weights appear once
    scheduler = opt.scheduler(optimizer, steps)
    losses, norms = [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(opt.accum):
            inputs, targets = batch_for_step(tokens, step * opt.accum + m)
            logits = model(input_ids=inputs).logits  # [batch, seq, vocab]
            # Mean cross-entropy over all batch * seq targets: no shift, the targets are already the next tokens.
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            total += loss.item()
            (loss / opt.accum).backward()
        losses.append(total / opt.accum)
        max_norm = opt.clip if opt.clip is not None else float("inf")
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    final = {name: p.detach().float().numpy().copy() for name, p in parameters(model).items()}
    return losses, final, validation_loss(model, val_tokens), norms


def key_bias_noise(seed: int, tokens: np.ndarray) -> dict[str, float]:
    """max |grad| of each layer's key-bias slice at step 0, next to max |grad| of the whole c_attn.bias."""
    model = make_model(seed)
    inputs, targets = batch_for_step(tokens, 0)
    logits = model(input_ids=inputs).logits
    F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
    out = {}
    for i in range(LAYERS):
        g = model.transformer.h[i].attn.c_attn.bias.grad
        out[f"h.{i} key-bias |grad| max"] = g[HIDDEN : 2 * HIDDEN].abs().max().item()
        out[f"h.{i} q/v-bias |grad| max"] = torch.cat([g[:HIDDEN], g[2 * HIDDEN :]]).abs().max().item()
    return out


# ---------------------------------------------------------------------------
# The side under test: optimusc run.


def config_flags() -> list[str]:
    values = {
        "vocab": VOCAB,
        "context": CONTEXT,
        "seq": SEQ,
        "batch": BATCH,
        "layers": LAYERS,
        "heads": HEADS,
        "hidden": HIDDEN,
        "pdrop": 0,
    }
    flags = []
    for name, value in values.items():
        flags += ["--set", f"{name}={value}"]
    return flags


def pipeline_flags(pipeline: str | None) -> list[str]:
    """`pp2-1f1b` -> --pipeline 2 --pipeline-schedule 1f1b (no flags without a pipeline; a trailing
    `-mpi` says where it runs, see `launcher`)."""
    if not pipeline:
        return []
    stages, _, schedule = pipeline.removeprefix("pp").removesuffix("-mpi").partition("-")
    return ["--pipeline", stages, "--pipeline-schedule", schedule or "1f1b"]


def launcher(mesh: str, pipeline: str | None) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment that start a run: none for threads; for a pipeline ending in
    `-mpi` (`pp2-1f1b-mpi`), mpirun with one process per device of every stage."""
    if not pipeline or not pipeline.endswith("-mpi"):
        return [], {}
    devices = math.prod(int(d) for d in mesh.split("x"))
    stages = int(pipeline.removeprefix("pp").split("-")[0])
    env = {
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "RAYON_NUM_THREADS": "1",
    }
    return ["mpirun", "-np", str(devices * stages), "--oversubscribe"], env


def run_optimusc(args, strategy: str, mesh: str, opt: Optimizer, init: Path, workdir: Path, tag: str, pipeline=None):
    """Runs optimusc; returns (per-step losses, final weights as numpy by key, seconds, validation loss
    (None for a pipeline, which does not validate), gradient norms)."""
    out = workdir / f"out_{tag}.safetensors"
    validation = [] if pipeline else ["--val-data", str(workdir / "val.bin"), "--eval-batches", str(VAL_BATCHES)]
    prefix, env = launcher(mesh, pipeline)
    cmd = [
        *prefix,
        str(args.optimusc), "run", str(MODEL),
        "--mesh", mesh, "--strategy", strategy,
        *config_flags(),
        "--steps", str(args.steps),
        "--data", str(workdir / "tokens.bin"), "--data-dtype", "u16",
        "--weights", str(init), "--save-weights", str(out),
        *validation,
        "--json", "--seed", str(args.seed),
        *opt.flags(),
        *pipeline_flags(pipeline),
    ]  # fmt: skip
    if args.verbose:
        print("  $ " + " ".join(cmd))
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout, env={**os.environ, **env})
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"optimusc exited {proc.returncode}:\n{proc.stderr.strip()}\n{proc.stdout.strip()}")
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    records = [r for r in lines if "val_loss" not in r and "pipeline" not in r]
    val = [r for r in lines if "val_loss" in r]
    if pipeline:
        if not any("pipeline" in r for r in lines):
            raise RuntimeError(f"a pipelined run printed no pipeline record:\n{proc.stdout}")
        val = [{"step": args.steps - 1, "val_loss": None}]
    if [r.get("step") for r in val] != [args.steps - 1]:
        raise RuntimeError(f"expected one validation record, after step {args.steps - 1}, got:\n{proc.stdout}")
    if [r.get("step") for r in records] != list(range(args.steps)):
        raise RuntimeError(f"expected steps 0..{args.steps - 1} on stdout, got:\n{proc.stdout}")
    losses = [r["loss"] for r in records]
    norms = [r.get("grad_norm") for r in records]
    if any(not isinstance(x, (int, float)) for x in losses + norms):
        raise RuntimeError(f"a step has no numeric loss or grad_norm:\n{proc.stdout}")
    return losses, load_numpy(str(out)), seconds, val[0]["val_loss"], norms


# ---------------------------------------------------------------------------
# Comparison.


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| (b the reference); max |a - b| when b is all zeros."""
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if b.size else 0.0
    return diff / scale if scale > 0 else diff


def compare(result: Result, losses, weights, ref_losses, ref_weights, tol: float):
    result.losses = losses
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        d = abs(a - b) / abs(b)
        result.loss_diffs.append(d)
        if not d <= tol:  # also catches NaN
            result.problems.append(f"step {step} loss {a:.7f} vs torch {b:.7f}: rel diff {d:.2e}")
    missing = sorted(set(ref_weights) - set(weights))
    extra = sorted(set(weights) - set(ref_weights))
    if missing:
        result.problems.append(f"saved weights lack {missing}")
    if extra:
        result.problems.append(f"saved weights have unexpected {extra}")
    for name in sorted(set(ref_weights) & set(weights)):
        a, b = weights[name], ref_weights[name]
        if a.shape != b.shape or a.dtype != np.float32:
            result.problems.append(f"{name}: saved {a.dtype}{list(a.shape)}, expected float32{list(b.shape)}")
            continue
        d = rel(a, b)
        result.weight_diffs[name] = d
        if not d <= tol:
            result.problems.append(f"{name}: max|a-b|/max|b| = {d:.2e}")


def compare_float64(result: Result, losses, weights, norms, reference, tol: float):
    """The same checks against the float64 reference (the float32 one is the table's): per-step losses
    and gradient norms, and every weight, within tol."""
    losses64, weights64, norms64 = reference
    for step, (a, b) in enumerate(zip(losses + norms, losses64 + norms64)):
        if not abs(a - b) <= tol * abs(b):
            what = "loss" if step < len(losses) else "grad_norm"
            result.problems.append(f"{what} {a:.7f} vs torch float64 {b:.7f}: rel diff {abs(a - b) / abs(b):.2e}")
    for name, b in weights64.items():
        if name in weights and weights[name].shape == b.shape and not rel(weights[name], b) <= tol:
            result.problems.append(f"{name}: max|a-b|/max|b| = {rel(weights[name], b):.2e} against torch float64")


def compare_norms(result: Result, norms, ref_norms, tol: float):
    """Every step's gradient norm before clipping, against torch's."""
    for step, (a, b) in enumerate(zip(norms, ref_norms)):
        d = abs(a - b) / abs(b)
        result.norm_diffs.append(d)
        if not d <= tol:
            result.problems.append(f"step {step} grad_norm {a:.7f} vs torch {b:.7f}: rel diff {d:.2e}")


def print_table(results: list[Result], tol: float):
    print()
    header = f"{'optimizer':<12} {'strategy':<9} {'mesh':<5} {'init file':<11} {'loss rel diff (max)':>19} {'norm':>8} " \
             f"{'weight rel diff (max)':>21}  {'worst tensor':<28} {'time':>6}  result"  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in results:
        if r.error is not None:
            row = f"{r.optimizer:<12} {r.strategy:<9} {r.mesh:<5} {r.init_file:<11} {'-':>19} {'-':>8} {'-':>21}  {'-':<28}"
            print(f"{row} {r.seconds:5.1f}s  RUN FAILED")
            continue
        worst = max(r.weight_diffs, key=r.weight_diffs.get) if r.weight_diffs else "-"
        wmax = r.weight_diffs.get(worst, float("nan"))
        lmax = max(r.loss_diffs) if r.loss_diffs else float("nan")
        nmax = max(r.norm_diffs) if r.norm_diffs else float("nan")
        status = "ok" if r.ok else "MISMATCH"
        short = worst.removeprefix("transformer.")
        print(f"{r.optimizer:<12} {r.strategy:<9} {r.mesh:<5} {r.init_file:<11} {lmax:>19.2e} {nmax:>8.1e} {wmax:>21.2e}  "
              f"{short:<28} {r.seconds:5.1f}s  {status}")  # fmt: skip
    print(f"(tolerance {tol:g}; loss and grad norm: |a-b|/|b| per step; weights: max|a-b|/max|b| per tensor, b = torch")
    print(" float32; the losses, norms and weights are also checked against torch float64 within the same tolerance)")


def main() -> int:
    global BATCH, LAYERS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimusc", type=Path, default=REPO / "target" / "release" / "optimusc")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--layers", type=int, default=LAYERS, help="repeated layers of the model (default %(default)s; pipelines of 4 stages need 4)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens (torch and numpy)")
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument(
        "--adamw-eps", type=float, default=1e-4, help="AdamW epsilon on both sides (default %(default)g; see above)"
    )
    parser.add_argument(
        "--optimizers",
        default="sgd,adamw,adamw-cosine,adamw-linear,adamw-clip,sgd-accum2,adamw-accum4,adamw-all",
        help="comma-separated subset of sgd,adamw,adamw-cosine,adamw-linear,adamw-clip,sgd-accum2,adamw-accum4,adamw-all"
    )
    parser.add_argument(
        "--meshes",
        default=",".join(f"{s}:{m}" for s, m in MESHES),
        help="comma-separated STRATEGY:MESH[:ppP-SCHEDULE[-mpi]] (a pipeline of P stages under GPipe, 1F1B or interleaved, "
        "on threads or, with -mpi, under mpirun: optimusc built with --features mpi) (default: %(default)s)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=BATCH,
        help="sequences per batch (default %(default)s; 8 lets tesseract 4x2x2 and 2x2x2x2 split it)",
    )
    parser.add_argument("--keep", type=Path, help="keep the files (weights, tokens, outputs) in this directory")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds one optimusc run may take")
    parser.add_argument("--details", action="store_true", help="print every tensor's difference")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the optimusc commands")
    args = parser.parse_args()
    BATCH = args.batch
    LAYERS = args.layers

    if not args.optimusc.exists():
        print(f"error: {args.optimusc} does not exist (cargo build --release)", file=sys.stderr)
        return 1
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    meshes = [tuple(pair.split(":")) for pair in args.meshes.split(",") if pair]
    optimizers = {
        "sgd": Optimizer("sgd", lr=0.1, weight_decay=0.01, momentum=0.9),
        "adamw": Optimizer("adamw", lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), eps=args.adamw_eps),
        "adamw-cosine": Optimizer(
            "adamw", lr=1e-2, weight_decay=0.1, eps=args.adamw_eps, schedule="cosine", warmup=1, min_lr=1e-3
        ),
        "adamw-linear": Optimizer(
            "adamw", lr=1e-2, weight_decay=0.1, eps=args.adamw_eps, schedule="linear", warmup=1, min_lr=1e-3
        ),
        "adamw-clip": Optimizer("adamw", lr=1e-2, weight_decay=0.1, eps=args.adamw_eps, clip=0.05, tag="adamw-clip"),
        "sgd-accum2": Optimizer("sgd", lr=0.1, weight_decay=0.01, momentum=0.9, accum=2, tag="sgd-accum2"),
        "adamw-accum4": Optimizer("adamw", lr=1e-2, weight_decay=0.1, eps=args.adamw_eps, accum=4, tag="adamw-accum4"),
        "adamw-all": Optimizer(
            "adamw", lr=1e-2, weight_decay=0.1, eps=args.adamw_eps, schedule="cosine", warmup=1, min_lr=1e-3,
            clip=0.05, accum=4, tag="adamw-all",
        ),
    }
    chosen = [optimizers[name] for name in args.optimizers.split(",") if name]

    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        workdir = args.keep
    else:
        workdir = Path(tempfile.mkdtemp(prefix="hf_compare_"))
    try:
        print(f"model: {MODEL.relative_to(REPO)} with vocab={VOCAB} context={CONTEXT} seq={SEQ} batch={BATCH} "
              f"layers={LAYERS} heads={HEADS} hidden={HIDDEN} pdrop=0; {args.steps} steps; "
              f"torch {torch.__version__}")  # fmt: skip
        model = make_model(args.seed)
        n_params = sum(p.numel() for p in parameters(model).values())
        inits = save_init_files(model, workdir)
        tokens = make_tokens(args.seed, workdir)
        val_tokens = make_val_tokens(args.seed, workdir)
        print(f"{n_params} parameters; {len(tokens)} tokens in tokens.bin, "
              f"{args.steps * BATCH * SEQ} read over {args.steps} steps (the reads wrap)")  # fmt: skip
        noise = key_bias_noise(args.seed, tokens)
        print("step-0 gradients of c_attn.bias (the key slice is analytically zero): "
              + ", ".join(f"{k} {v:.1e}" for k, v in noise.items()))  # fmt: skip

        results: list[Result] = []
        run_index = 0
        for opt in chosen:
            print(f"\n== {opt.describe()}")
            if opt.name == "adamw":
                print(f"   eps {opt.eps:g} on both sides (PyTorch's default is 1e-8): AdamW's step is ill-conditioned for")
                print("   elements with |grad| <~ eps, where float32 noise in the gradient (~1e-9 here) moves a weight by up")
                print("   to lr * noise / eps; eps 1e-4 keeps that ~1e-7. Every element of every tensor is checked.")
            start = time.monotonic()
            ref_losses, ref_weights, ref_val, ref_norms = train_torch(args.seed, tokens, opt, args.steps, val_tokens)
            print(f"   torch: {time.monotonic() - start:.1f}s, losses " + " ".join(f"{x:.6f}" for x in ref_losses)
                  + f", validation loss {ref_val:.6f}, grad norms " + " ".join(f"{x:.5f}" for x in ref_norms))  # fmt: skip
            if opt.clip is not None and not all(n > opt.clip for n in ref_norms):
                print(f"   warning: clip {opt.clip} does not clip every step (norms {ref_norms})")
            # The float32 noise floor: the same reference in float64, against the float32 one.
            losses64, weights64, val64, norms64 = train_torch(args.seed, tokens, opt, args.steps, val_tokens, dtype=torch.float64)
            floor_loss = max(abs(a - b) / abs(b) for a, b in zip(ref_losses, losses64))
            floor_w = {n: rel(ref_weights[n], w) for n, w in weights64.items()}
            worst = max(floor_w, key=floor_w.get)
            print(f"   torch float32 vs float64 (noise floor): loss rel diff {floor_loss:.2e}, "
                  f"weight rel diff {floor_w[worst]:.2e} ({worst.removeprefix('transformer.')})")  # fmt: skip
            for strategy, mesh, *pipeline in meshes:
                pipeline = pipeline[0] if pipeline else None
                # Cycle through the key styles across runs.
                style = list(inits)[run_index % len(inits)]
                run_index += 1
                shown = f"{mesh} {pipeline}" if pipeline else mesh
                result = Result(opt.label, strategy, shown, style)
                tag = f"{opt.label}_{strategy}_{mesh}_{pipeline or ''}"
                try:
                    losses, weights, result.seconds, val, norms = run_optimusc(
                        args, strategy, mesh, opt, inits[style], workdir, tag, pipeline
                    )
                    compare(result, losses, weights, ref_losses, ref_weights, args.tol)
                    compare_norms(result, norms, ref_norms, args.tol)
                    compare_float64(result, losses, weights, norms, (losses64, weights64, norms64), args.tol)
                    # The validation loss after the last update (eval mode, VAL_BATCHES batches of val.bin).
                    # A pipelined run does not validate (val is None).
                    if val is not None:
                        d = abs(val - ref_val) / abs(ref_val)
                        result.loss_diffs.append(d)
                        if not d <= args.tol:
                            result.problems.append(f"validation loss {val:.7f} vs torch {ref_val:.7f}: rel diff {d:.2e}")
                        print(f"   {strategy} {mesh}: validation loss {val:.9f} (torch {ref_val:.9f}, rel diff {d:.2e})")
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    result.error = str(e)
                results.append(result)
                status = "ok" if result.ok else ("RUN FAILED" if result.error else "MISMATCH")
                losses_text = " ".join(f"{x:.6f}" for x in result.losses)
                print(f"   {strategy} {shown} ({style} names): {status}  {result.seconds:.1f}s  losses {losses_text}")
                if result.error:
                    print("      " + result.error.replace("\n", "\n      "))
                for p in result.problems:
                    print(f"      {p}")
                if args.details:
                    for name, d in result.weight_diffs.items():
                        print(f"      {name:<40} {d:.2e}")

        print_table(results, args.tol)
        failed = [r for r in results if not r.ok]
        if failed:
            print(f"\nFAIL: {len(failed)} of {len(results)} runs disagree with Hugging Face")
        else:
            print(f"\nPASS: all {len(results)} runs agree with Hugging Face within {args.tol:g}")
        # The plain summary line CI reads last: one "test" per run.
        print(f"hf_compare: {len(results) - len(failed)} passed, {len(failed)} failed")
        return 1 if failed else 0
    finally:
        if args.keep:
            print(f"files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
