#!/usr/bin/env python3
"""Compare examples/bert.opt run by `optimusc run --objective mlm` with Hugging Face's BertForMaskedLM in float64.

Both sides start from the same weights (BertForMaskedLM's initialisation with initializer_range 0.2, so that the
attention is far from uniform; every LayerNorm weight and bias and every linear bias then perturbed so that one
loaded or updated in the wrong place would show), read the same tokens, token types and MLM labels, and apply
the same optimizer. The reference runs in float64; optimusc in float32. For
every (config, optimizer, mesh) the script checks, with tol = 1e-4,

  * every step's loss:                     |loss_optimus - loss_torch| / |loss_torch|   <= tol
  * every parameter after the last step:   max|w_optimus - w_torch| / max|w_torch|     <= tol (per tensor)

  configs     base    heads 4, ffn 256 (4 * hidden, BERT's ratio: the intermediate and output linears are not
                      square) on none 1x1, optimus 2x2 and 4x4, megatron 1x4
              square  heads 8, ffn 64 (= hidden: every linear of the encoder is square, where a weight loaded
                      [in, out] instead of [out, in] would still fit), on the same four meshes
              both with vocab 333 (divisible by neither 2 nor 4: optimusc pads the embedding and the tied decoder),
              hidden 64, 2 layers, 2 token types, 32 positions, seq 16, batch 4, layer_norm_eps 1e-12, exact
              (erf) GELU, no dropout, eager attention
  optimizers  SGD    lr 0.1, momentum 0.9, weight_decay 0.01  (torch.optim.SGD)
              AdamW  lr 1e-2, betas (0.9, 0.999), eps 1e-4, weight_decay 0.1  (torch.optim.AdamW; eps as in
                     scripts/hf_compare.py, which explains why 1e-8 is ill-conditioned in float32)
  files       the initial weights are written with save_pretrained: `bert.`/`cls.` names, [out, in] linear
              weights, the tied decoder's weight left out and its bias stored as `cls.predictions.bias` (what
              transformers 5 writes; optimusc reads it for bert.opt's `cls.predictions.decoder.bias`).

Data rule (the one `optimusc run --objective mlm` implements, docs/data.md): step k, sequence r reads the
files at o = (k * batch + r) * seq, wrapping at the end: tokens, token types and labels at o .. o + seq - 1, the
labels not shifted. A label of 65535 (the u16 ignore id) is -100 for torch; the loss is the mean cross-entropy
over the other positions. About 15% of the positions carry a label. The reference loss is BertForMaskedLM's own
(labels=...), checked against F.cross_entropy(logits, labels, ignore_index=-100) at every step.

A control shows that a misoriented square weight is caught: the initial file with one query weight stored
transposed (it still loads, being square) must give a step-0 loss outside the tolerance on optimus 2x2.

After `--save-weights`, every tensor optimusc writes is compared by name with the reference's state dict, and
every reference tensor must be covered: `cls.predictions.decoder.weight` is the word embedding table and
`cls.predictions.bias` the decoder's bias (the script checks that the reference ties them so).

Usage (scripts/hf_compare.sh sets up the venv and builds optimusc first):
    python scripts/hf_bert_compare.py --optimusc target/release/optimusc [--steps 3] [--keep DIR]
Exit status: 0 when everything agrees, 1 on any mismatch or failed run.
"""

from __future__ import annotations

import argparse
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
from safetensors.numpy import load_file as load_numpy
from transformers import BertConfig, BertForMaskedLM
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "examples" / "bert.opt"

VOCAB, CONTEXT, SEQ, BATCH, LAYERS, HIDDEN, TYPES = 333, 32, 16, 4, 2, 64, 2
EPS = 1e-12
IGNORE = 65535  # the u16 ignore id; -100 for torch
MASKED = 0.15  # the share of positions that carry a label
# BertConfig.initializer_range, 10 times BERT's 0.02: at 0.02 the attention is almost uniform and the logits almost
# zero, so the loss hardly depends on the query and key weights (a transposed query weight moves the first loss
# by 3e-8); at 0.2 it moves it by 2e-2, and the misoriented control below would fail at 0.02.
INIT_STD = 0.2

# name -> (heads, ffn, meshes)
CONFIGS = {
    "base": (4, 4 * HIDDEN, ALL_MESHES),
    "square": (8, HIDDEN, ALL_MESHES),
}
# Reference tensors that are another tensor under a second name: name -> the name optimusc saves it under.
TIED = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.bias": "cls.predictions.decoder.bias",
}




@dataclass
class Result:
    config: str
    optimizer: str
    strategy: str
    mesh: str
    seconds: float = 0.0
    error: str | None = None
    loss_diff: float = 0.0
    weight_diff: float = 0.0
    worst: str = "-"
    compared: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems


def make_model(seed: int, heads: int, ffn: int) -> BertForMaskedLM:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        intermediate_size=ffn,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=CONTEXT,
        type_vocab_size=TYPES,
        layer_norm_eps=EPS,
        initializer_range=INIT_STD,
        tie_word_embeddings=True,
        pad_token_id=0,  # [PAD]: its word embedding row gets no gradient from the lookup (bert.opt's padding_idx)
    )
    config._attn_implementation = "eager"
    model = BertForMaskedLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.train()
    return model


def save_init(model: BertForMaskedLM, workdir: Path, tag: str) -> Path:
    directory = workdir / f"{tag}_init"
    model.save_pretrained(str(directory), safe_serialization=True)
    assert (directory / "model.safetensors").is_file(), "one file expected"
    return directory


def make_data(seed: int, workdir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, token types (runs of 0 and 1 of random length) and labels (MASKED of them real), as u16 files."""
    rng = np.random.default_rng(seed)
    n = 3 * BATCH * SEQ + 37
    tokens = rng.integers(0, VOCAB, size=n, dtype=np.uint16)
    tokens[[5, 77, n - 1]] = VOCAB - 1
    tokens[[3, 40, 41, n // 2]] = 0  # the padding id, whose lookup gives its row no gradient
    segments = np.zeros(n, dtype=np.uint16)
    start, kind = 0, 0
    while start < n:
        length = int(rng.integers(1, SEQ))
        segments[start : start + length] = kind
        start, kind = start + length, 1 - kind
    labels = np.full(n, IGNORE, dtype=np.uint16)
    chosen = rng.random(n) < MASKED
    labels[chosen] = rng.integers(0, VOCAB, size=int(chosen.sum()), dtype=np.uint16)
    labels[[3, n - 2]] = VOCAB - 1
    for name, values in (("tokens", tokens), ("segments", segments), ("labels", labels)):
        values.astype("<u2").tofile(workdir / f"{name}.bin")
    return tokens, segments, labels


def batch_for_step(files, step: int):
    """input_ids, token_type_ids and labels (-100 where ignored) of one step, [batch, seq] int64."""
    tokens, segments, labels = files
    n = len(tokens)
    offsets = [((step * BATCH + r) * SEQ + np.arange(SEQ)) % n for r in range(BATCH)]
    ids, kinds, targets = (torch.from_numpy(np.stack([a[o] for o in offsets]).astype(np.int64))
                           for a in (tokens, segments, labels))  # fmt: skip
    targets[targets == IGNORE] = -100
    return ids, kinds, targets


def train_torch(seed, heads, ffn, files, opt: Optimizer, steps: int):
    """The float64 reference: per-step losses and the final state dict as numpy float64."""
    model = make_model(seed, heads, ffn).to(torch.float64)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias
    optimizer = opt.torch(model.parameters())
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        ids, kinds, targets = batch_for_step(files, step)
        out = model(input_ids=ids, token_type_ids=kinds, labels=targets)
        by_hand = F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
        assert abs(out.loss.item() - by_hand.item()) <= 1e-12 * abs(by_hand.item()), (out.loss, by_hand)
        out.loss.backward()
        losses.append(out.loss.item())
        optimizer.step()
    return losses, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def config_flags(heads: int, ffn: int) -> list[str]:
    values = {
        "vocab": VOCAB, "context": CONTEXT, "seq": SEQ, "batch": BATCH, "layers": LAYERS, "heads": heads,
        "hidden": HIDDEN, "ffn": ffn, "types": TYPES, "eps": EPS, "pdrop": 0,
    }  # fmt: skip
    return set_flags(values)


def run_optimusc(args, heads, ffn, strategy, mesh, opt, init: Path, workdir: Path, tag: str):
    out = workdir / f"out_{tag}.safetensors"
    cmd = [
        str(args.optimusc), "run", str(MODEL), "--mesh", mesh, "--strategy", strategy,
        *config_flags(heads, ffn), "--steps", str(args.steps), "--objective", "mlm",
        "--data", str(workdir / "tokens.bin"), "--segments", str(workdir / "segments.bin"),
        "--labels", str(workdir / "labels.bin"), "--data-dtype", "u16",
        "--weights", str(init), "--save-weights", str(out), "--json", *opt.flags(),
    ]  # fmt: skip
    return run_records(args, cmd, out)


def compare(result: Result, losses, weights, ref_losses, ref_weights, tol):
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        d = abs(a - b) / abs(b)
        result.loss_diff = max(result.loss_diff, d)
        if not d <= tol:
            result.problems.append(f"step {step} loss {a:.7f} vs torch float64 {b:.7f}: rel diff {d:.2e}")
    for alias, name in TIED.items():
        if alias in ref_weights and not np.array_equal(ref_weights[alias], ref_weights.get(name)):
            result.problems.append(f"torch's {alias} is not its {name}")
    uncovered = sorted(set(ref_weights) - set(weights) - {a for a, n in TIED.items() if n in weights})
    extra = sorted(set(weights) - set(ref_weights))
    if uncovered or extra:
        result.problems.append(f"tensor names differ: not saved {uncovered}, unknown to torch {extra}")
    for name in sorted(set(weights) & set(ref_weights)):
        a, b = weights[name], ref_weights[name]
        if a.shape != b.shape:
            result.problems.append(f"{name}: saved {list(a.shape)}, torch {list(b.shape)}")
            continue
        d = rel(a, b)
        result.compared += 1
        if d > result.weight_diff:
            result.weight_diff, result.worst = d, name
        if not d <= tol:
            result.problems.append(f"{name}: max|a-b|/max|b| = {d:.2e}")


def misoriented_control(args, heads, ffn, init: Path, ref_loss: float, workdir: Path) -> str | None:
    """The step-0 loss from a file whose first query weight is transposed must differ: an error text if not."""
    from safetensors.numpy import save_file

    tensors = load_numpy(str(init / "model.safetensors"))
    name = "bert.encoder.layer.0.attention.self.query.weight"
    tensors[name] = np.ascontiguousarray(tensors[name].T)
    bad = workdir / "misoriented.safetensors"
    save_file(tensors, str(bad), metadata={"format": "pt"})
    one_step = argparse.Namespace(**{**vars(args), "steps": 1})
    losses, _, _ = run_optimusc(one_step, heads, ffn, "optimus", "2x2", OPTIMIZERS["sgd"], bad, workdir, "control")
    d = abs(losses[0] - ref_loss) / abs(ref_loss)
    print(f"   control: {name} transposed gives step-0 loss {losses[0]:.7f}, rel diff {d:.1e} "
          f"({'caught' if d > args.tol else 'NOT CAUGHT'})")  # fmt: skip
    return None if d > args.tol else f"a transposed {name} went unnoticed (loss rel diff {d:.1e})"


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
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="hf_bert_"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    problems: list[str] = []
    try:
        print(f"model: {MODEL.relative_to(REPO)} with vocab={VOCAB} hidden={HIDDEN} layers={LAYERS} types={TYPES} "
              f"context={CONTEXT} seq={SEQ} batch={BATCH}; {args.steps} steps; reference BertForMaskedLM float64, "
              f"torch {torch.__version__}")  # fmt: skip
        files = make_data(args.seed, workdir)
        labelled = int((files[2] != IGNORE).sum())
        print(f"data: {len(files[0])} positions, {labelled} labelled, token types 0/1 "
              f"({int(files[1].sum())} of type 1)")  # fmt: skip
        for cname in [c for c in args.configs.split(",") if c]:
            heads, ffn, meshes = CONFIGS[cname]
            model = make_model(args.seed, heads, ffn)
            n_params = sum(p.numel() for p in model.parameters())
            init = save_init(model, workdir, cname)
            print(f"\n== {cname}: heads {heads}, ffn {ffn}, {n_params} parameters")
            control_done = cname != "square"
            for oname in [o for o in args.optimizers.split(",") if o]:
                opt = OPTIMIZERS[oname]
                ref_losses, ref_weights = train_torch(args.seed, heads, ffn, files, opt, args.steps)
                print(f"   {oname}: torch float64 losses " + " ".join(f"{x:.7f}" for x in ref_losses))
                if not control_done:
                    control_done = True
                    try:
                        error = misoriented_control(args, heads, ffn, init, ref_losses[0], workdir)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        error = f"the control run failed: {e}"
                    if error is not None:
                        problems.append(error)
                for strategy, mesh in meshes:
                    result = Result(cname, oname, strategy, mesh)
                    try:
                        losses, weights, result.seconds = run_optimusc(
                            args, heads, ffn, strategy, mesh, opt, init, workdir, f"{cname}_{oname}_{mesh}"
                        )
                        compare(result, losses, weights, ref_losses, ref_weights, args.tol)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        result.error = str(e)
                    results.append(result)
                    status = "ok" if result.ok else ("RUN FAILED" if result.error else "MISMATCH")
                    print(f"   {oname:<6} {strategy:<8} {mesh:<4}: {status}  loss {result.loss_diff:.1e}  "
                          f"weights {result.weight_diff:.1e} ({result.worst}; {result.compared} tensors)  "
                          f"{result.seconds:.1f}s")  # fmt: skip
                    for line in ([result.error] if result.error else []) + result.problems[:8]:
                        print("      " + line.replace("\n", "\n      "))
        failed = [r for r in results if not r.ok]
        print(f"\n(tolerance {args.tol:g}: loss |a-b|/|b| per step, weights max|a-b|/max|b| per tensor, "
              "b = BertForMaskedLM in float64)")  # fmt: skip
        ok = not failed and not problems
        print(("PASS" if ok else "FAIL") + f": {len(results) - len(failed)} of {len(results)} runs agree"
              + (f"; {len(problems)} control checks failed" if problems else ""))  # fmt: skip
        print(f"hf_bert_compare: {len(results) - len(failed)} passed, {len(failed) + len(problems)} failed")
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
