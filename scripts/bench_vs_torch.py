"""Training throughput of `optimusc run` against PyTorch eager and `torch.compile`, side by side in one run.

For each GPT-2-shaped config, trains Hugging Face's GPT2LMHeadModel (float32, AdamW, dropout off,
eager attention) and `optimusc run examples/gpt2.opt` with the same sizes on several meshes, all on the
same number of threads, and prints tokens/s and each mesh's ratio to torch. A benchmark, not a test:
absolute numbers drift on shared machines; quote the ratios of one run.

Each measurement is the median of the per-step throughputs after `--warmup` untimed steps. Before and
after each config a `torch.mm` times the machine's speed; where the two are more than 10% apart a
warning says the config's ratios are within the machine's noise (`speed_probe_gflops` with --json).
Run it through scripts/bench_vs_torch.sh, which provides torch and a release optimusc.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_noise import UNSTEADY, spread

# --isa NAME narrows both sides to the vector instructions of a narrower CPU, to measure on an AVX-512
# machine what an AVX2 one does: PyTorch's own kernels, MKL and oneDNN read their caps when they load,
# so the variables are set here, before torch is imported; optimusc inherits OPTIMUS_CPU_ISA.
ISA_CAPS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "baseline": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}


def isa_cap_from_argv(argv: list[str]) -> str | None:
    """The value of --isa (either `--isa X` or `--isa=X`), if given."""
    for k, arg in enumerate(argv):
        if arg == "--isa" and k + 1 < len(argv):
            return argv[k + 1]
        if arg.startswith("--isa="):
            return arg.split("=", 1)[1]
    return None


ISA_CAP = isa_cap_from_argv(sys.argv[1:])
if ISA_CAP in ISA_CAPS:
    os.environ.update(ISA_CAPS[ISA_CAP])
    os.environ["OPTIMUS_CPU_ISA"] = ISA_CAP
    # Inductor's cache of compiled kernels does not tell the caps apart: a kernel built without them
    # failed under them. Each cap gets its own cache.
    import tempfile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor-{ISA_CAP}"))

import torch  # noqa: E402  (after the caps above)
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

# name -> (layers, hidden, heads, vocab, seq, batch)
CONFIGS = {
    "small": (4, 256, 8, 8192, 128, 8),
    "mid": (4, 512, 8, 32768, 128, 8),
    "gpt2-wide": (2, 768, 12, 50257, 128, 4),
}


def custom_config(text: str) -> tuple[str, tuple[int, ...]]:
    """NAME=LAYERS,HIDDEN,HEADS,VOCAB,SEQ,BATCH, for --config."""
    name, _, sizes = text.partition("=")
    values = tuple(int(v) for v in sizes.split(","))
    if not name or len(values) != 6 or min(values) < 1 or values[1] % values[2]:
        raise argparse.ArgumentTypeError("expected NAME=LAYERS,HIDDEN,HEADS,VOCAB,SEQ,BATCH (heads dividing hidden)")
    return name, values

# (strategy, mesh) pairs measured for optimusc.
MESHES = [("none", "1x1"), ("optimus", "2x2"), ("megatron", "1x2"), ("megatron", "1x4")]


def cpu_description() -> str:
    """The CPU's model name and the widest vector instructions it has (AVX-512, AVX2), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return "unknown CPU"
    name = next((l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")), "unknown CPU")
    flags = next((l.split(":", 1)[1].split() for l in lines if l.startswith("flags")), [])
    width = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    capped = f" capped to {ISA_CAP} (--isa)" if ISA_CAP in ISA_CAPS else ""
    return f"{name}, {width}{capped}"


def speed_probe(threads: int) -> float:
    """This machine's speed now: float32 GFLOP/s of a 1024x1024x1024 `torch.mm`, the best of 5 (about
    0.1 s), on the benchmark's threads. Taken before and after each config, so that a machine whose
    speed changed between the measurements being compared says so."""
    torch.set_num_threads(threads)
    a, b = torch.rand(1024, 1024), torch.rand(1024, 1024)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * 1024**3 / best / 1e9


def torch_tokens_per_s(sizes: tuple[int, ...], steps: int, warmup: int, threads: int, compiled: bool = False) -> float:
    """Median training tokens/s of GPT2LMHeadModel in eager mode, or under `torch.compile` (whose
    compilation happens in the warm-up steps, which are not timed)."""
    layers, hidden, heads, vocab, seq, batch = sizes
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config).float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward = torch.compile(model) if compiled else model
    rates = []
    for step in range(warmup + steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1))
        start = time.perf_counter()
        logits = forward(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        elapsed = time.perf_counter() - start
        if step >= warmup:
            rates.append(batch * seq / elapsed)
    return statistics.median(rates)


def optimusc_tokens_per_s(
    optimusc: str, sizes: tuple[int, ...], strategy: str, mesh: str, steps: int, warmup: int, threads: int
) -> float | str:
    layers, hidden, heads, vocab, seq, batch = sizes
    sets = {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "context": seq, "seq": seq}
    sets.update({"batch": batch, "pdrop": "0.0"})
    command = [optimusc, "run", "examples/gpt2.opt", "--mesh", mesh, "--strategy", strategy]
    for name, value in sets.items():
        command += ["--set", f"{name}={value}"]
    command += ["--steps", str(warmup + steps), "--json", "--lr", "1e-3"]
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["(no message)"]
        return f"failed: {last[0]}"
    rates = [json.loads(line)["tokens_per_s"] for line in done.stdout.splitlines()]
    return statistics.median(rates[warmup:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimusc", required=True, help="path to a release optimusc")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    parser.add_argument(
        "--config",
        type=custom_config,
        action="append",
        default=[],
        metavar="NAME=L,H,A,V,S,B",
        help="a config of your own (layers, hidden, heads, vocab, seq, batch); repeatable, measured after --configs",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both (default: all cores)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per config instead of a table")
    parser.add_argument(
        "--no-compile", action="store_true", help="leave out torch.compile (its compilation takes minutes on 2 cores)"
    )
    parser.add_argument(
        "--isa",
        choices=sorted(ISA_CAPS),
        help="narrow both sides to these vector instructions (PyTorch, MKL and oneDNN by their own variables, "
        "optimusc by OPTIMUS_CPU_ISA; faer's products in optimusc are not narrowed)",
    )
    args = parser.parse_args()
    if not args.no_compile and args.warmup < 1:
        parser.error("torch.compile needs --warmup 1 or more (it compiles during the first step)")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    for name, sizes in args.config:
        CONFIGS[name] = sizes
        names.append(name)
    if unknown or args.steps < 1 or args.warmup < 0 or args.threads < 1:
        parser.error(f"unknown configs {unknown}" if unknown else "steps >= 1, warmup >= 0, threads >= 1")
    compile_column = "" if args.no_compile else "torch.compile  "
    header = f"config      layers hidden heads vocab  seq batch  torch tok/s  {compile_column}" + "  ".join(
        f"{s} {m}".ljust(13) for s, m in MESHES
    )
    cpu = cpu_description()
    if not args.json:
        print(f"CPU: {cpu}; threads: {args.threads}; ratios are tokens/s over torch eager tokens/s, measured in this run")
        print(header)
        print("-" * len(header))
    for name in names:
        sizes = CONFIGS[name]
        speed_before = speed_probe(args.threads)
        reference = torch_tokens_per_s(sizes, args.steps, args.warmup, args.threads)
        compiled: float | str | None = None
        if not args.no_compile:
            try:
                compiled = torch_tokens_per_s(sizes, args.steps, args.warmup, args.threads, compiled=True)
            except Exception as error:  # torch.compile needs a C++ compiler; say why it failed
                compiled = f"failed: {str(error).splitlines()[0][:60] if str(error) else type(error).__name__}"
        results = {}
        for strategy, mesh in MESHES:
            results[f"{strategy} {mesh}"] = optimusc_tokens_per_s(
                args.optimusc, sizes, strategy, mesh, args.steps, args.warmup, args.threads
            )
        speed = (speed_before, speed_probe(args.threads))
        apart = spread(speed)
        if apart > UNSTEADY:
            print(f"warning: {name}: this machine's speed changed during the config's measurements (a torch.mm "
                  f"at {speed[0]:.0f} GFLOP/s before, {speed[1]:.0f} after, {100 * apart:.0f}% apart): "
                  "its ratios are no closer than that", file=sys.stderr)
        if args.json:
            record = {"config": name, "sizes": sizes, "cpu": cpu, "threads": args.threads}
            record["speed_probe_gflops"] = {"before": speed[0], "after": speed[1], "apart": apart}
            record["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
            record.update({"torch_tokens_per_s": reference, "torch_compile_tokens_per_s": compiled, "optimusc": results})
            print(json.dumps(record))
            continue
        def cell(v: float | str) -> str:
            return f"{v / reference:.2f}x ({v:.0f})" if isinstance(v, float) else str(v)

        cells = [cell(v) for v in results.values()]
        compile_cell = "" if compiled is None else cell(compiled).ljust(13) + "  "
        sizes_text = "{:>6} {:>6} {:>5} {:>5} {:>4} {:>5}".format(*sizes)
        print(f"{name:<11} {sizes_text}  {reference:>11.0f}  {compile_cell}" + "  ".join(c.ljust(13) for c in cells))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
