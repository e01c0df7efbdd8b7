"""GPU training throughput of `optimusc run --backend cuda` against PyTorch, side by side in one run.

A benchmark, not a test: run it on a GPU machine (scripts/bench_gpu.sh). For one GPT-2-shaped config
(default GPT-2 small: 12 layers, hidden 768, 12 heads, vocab 50257, seq 1024, batch 8) it trains
Hugging Face's GPT2LMHeadModel with AdamW (lr 1e-3, dropout off) in bf16 autocast with float32 master
weights (what `--precision bf16` does) with eager attention, with SDPA attention, and under
torch.compile (SDPA), then `optimusc run examples/gpt2.opt --backend cuda --precision bf16` with the
same sizes on each mesh of --meshes (devices share the GPU where a mesh has more than one).

Each figure is the median tokens/s of --steps timed steps after --warmup untimed ones. FLOPs per
token are 6 N + 12 L S H (N: parameters without the position table; the PaLM / Megatron count), the
same for every row; MFU is against --peak-tflops (default 989, the H100/H200 bf16 dense peak).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def torch_rate(sizes, attention, compiled, precision, steps, warmup):
    layers, hidden, heads, vocab, seq, batch = sizes
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = attention
    model = GPT2LMHeadModel(config).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward = torch.compile(model) if compiled else model
    rates = []
    for step in range(warmup + steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = forward(tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        if step >= warmup:
            rates.append(batch * seq / (time.perf_counter() - start))
    return statistics.median(rates)


def optimusc_rate(optimusc, sizes, strategy, mesh, precision, steps, warmup, env=None):
    layers, hidden, heads, vocab, seq, batch = sizes
    sets = dict(layers=layers, hidden=hidden, heads=heads, vocab=vocab, context=seq, seq=seq, batch=batch, pdrop="0.0")
    command = [optimusc, "run", "examples/gpt2.opt", "--backend", "cuda", "--precision", precision,
               "--mesh", mesh, "--strategy", strategy, "--steps", str(warmup + steps), "--json", "--lr", "1e-3"]
    for name, value in sets.items():
        command += ["--set", f"{name}={value}"]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        return "failed: " + (done.stderr.strip().splitlines() or ["(no message)"])[-1], command
    rates = [json.loads(line)["tokens_per_s"] for line in done.stdout.splitlines() if line.startswith("{")]
    return statistics.median(rates[warmup:]), command


def gpu_driver():
    done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def write_jsonl(args, rows, sizes, flops_per_token):
    """One JSON line per system, appended to --jsonl."""
    common = {"gpu": torch.cuda.get_device_name(), "driver": gpu_driver(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "precision": args.precision,
              "config": dict(zip(["layers", "hidden", "heads", "vocab", "seq", "batch"], sizes)),
              "flops_per_token": flops_per_token, "peak_tflops": args.peak_tflops,
              "steps": args.steps, "warmup": args.warmup}
    with open(args.jsonl, "a", encoding="utf-8") as out:
        for system, rate in rows.items():
            record = dict(common, system=system)
            if system.startswith("optimusc "):
                record["strategy"], record["mesh"] = system.split()[1:3]
            else:
                record["mesh"] = "1x1"
            if not isinstance(rate, str):
                record["step_s"] = sizes[4] * sizes[5] / rate
            if isinstance(rate, str):
                record["error"] = rate
            else:
                tflops = rate * flops_per_token / 1e12
                record.update(tokens_per_s=rate, tflops=tflops, mfu=tflops / args.peak_tflops)
            out.write(json.dumps(record) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimusc", default="target/release/optimusc", help="a release optimusc built with --features cuda")
    parser.add_argument("--config", default="12,768,12,50257,1024,8", metavar="L,H,A,V,S,B",
                        help="layers, hidden, heads, vocab, seq, batch (default GPT-2 small at batch 8)")
    parser.add_argument("--meshes", default="none:1x1", help="comma-separated STRATEGY:MESH for optimusc (default none:1x1)")
    parser.add_argument("--precision", choices=["bf16", "f32"], default="bf16", help="both sides (default bf16)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense peak for MFU (default 989)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    parser.add_argument("--reference-attention", action="store_true",
                        help="also run each optimusc mesh with OPTIMUS_CUDA_ATTENTION=reference (the cuBLAS attention "
                             "that materialises the scores), beside the flash attention")
    parser.add_argument("--scalar-kernels", action="store_true",
                        help="also run each optimusc mesh with OPTIMUS_CUDA_VECTOR=off (bf16 elementwise kernels one "
                             "element a thread, as before the eight-wide ones), beside the default")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:VAR=VALUE",
                        help="also run each optimusc mesh with environment variable VAR=VALUE, as row "
                             "'optimusc STRATEGY MESH LABEL' (repeatable; e.g. batch-off:OPTIMUS_CUDA_BATCH=off)")
    parser.add_argument("--baseline", metavar="PATH",
                        help="also run each optimusc mesh with the optimusc at PATH (an older build, for a "
                             "before/after measured in the same call), as row 'optimusc STRATEGY MESH baseline'")
    parser.add_argument("--only-optimusc", action="store_true", help="skip the PyTorch rows")
    parser.add_argument("--jsonl", metavar="PATH",
                        help="append one JSON line per system (system, config, tokens/s, TFLOP/s, MFU, GPU, driver, "
                             "date) to PATH: the raw results to commit under bench/results/")
    args = parser.parse_args()
    sizes = tuple(int(v) for v in args.config.split(","))
    if len(sizes) != 6 or sizes[1] % sizes[2] or args.steps < 1 or args.warmup < 0:
        parser.error("--config needs 6 numbers with heads dividing hidden; --steps >= 1; --warmup >= 0")
    layers, hidden, heads, vocab, seq, batch = sizes
    params = 12 * layers * hidden * hidden + 13 * layers * hidden + vocab * hidden + 2 * hidden
    flops_per_token = 6 * params + 12 * layers * seq * hidden
    rows = {}
    if not args.only_optimusc:
        rows["torch eager"] = torch_rate(sizes, "eager", False, args.precision, args.steps, args.warmup)
        rows["torch sdpa"] = torch_rate(sizes, "sdpa", False, args.precision, args.steps, args.warmup)
    if not args.no_compile and not args.only_optimusc:
        try:
            rows["torch.compile sdpa"] = torch_rate(sizes, "sdpa", True, args.precision, args.steps, args.warmup)
        except Exception as error:  # torch.compile can fail in many ways; the other rows still count
            rows["torch.compile sdpa"] = "failed: " + (str(error).splitlines() or [""])[0]
    commands = {}
    for item in args.meshes.split(","):
        strategy, mesh = item.split(":")
        rows[f"optimusc {strategy} {mesh}"], commands[mesh] = optimusc_rate(
            args.optimusc, sizes, strategy, mesh, args.precision, args.steps, args.warmup)
        if args.reference_attention:
            env = dict(os.environ, OPTIMUS_CUDA_ATTENTION="reference")
            rows[f"optimusc {strategy} {mesh} ref-attn"], _ = optimusc_rate(
                args.optimusc, sizes, strategy, mesh, args.precision, args.steps, args.warmup, env)
        if args.scalar_kernels:
            env = dict(os.environ, OPTIMUS_CUDA_VECTOR="off")
            rows[f"optimusc {strategy} {mesh} scalar"], _ = optimusc_rate(
                args.optimusc, sizes, strategy, mesh, args.precision, args.steps, args.warmup, env)
        for variant in args.variant:
            label, setting = variant.split(":", 1)
            name, value = setting.split("=", 1)
            env = dict(os.environ, **{name: value})
            rows[f"optimusc {strategy} {mesh} {label}"], _ = optimusc_rate(
                args.optimusc, sizes, strategy, mesh, args.precision, args.steps, args.warmup, env)
        if args.baseline:
            rows[f"optimusc {strategy} {mesh} baseline"], _ = optimusc_rate(
                args.baseline, sizes, strategy, mesh, args.precision, args.steps, args.warmup)
    if args.jsonl:
        write_jsonl(args, rows, sizes, flops_per_token)
    eager = rows.get("torch eager")
    if args.json:
        print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sizes": sizes,
                          "flops_per_token": flops_per_token, "tokens_per_s": rows, "commands": commands}))
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"{args.precision}, config L,H,A,V,S,B = {args.config}, {flops_per_token / 1e6:.0f} MFLOP/token")
    print(f"{'system':<26} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'vs eager':>9}")
    for name, rate in rows.items():
        if isinstance(rate, str):
            print(f"{name:<26} {rate}")
            continue
        tflops = rate * flops_per_token / 1e12
        versus = f"{rate / eager:>8.2f}x" if isinstance(eager, float) else "       -"
        print(f"{name:<26} {rate:>10.0f} {tflops:>8.1f} {100 * tflops / args.peak_tflops:>5.1f}% {versus}")
    for mesh, command in commands.items():
        print(f"optimusc {mesh}: {' '.join(command)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
