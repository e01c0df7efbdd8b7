"""bf16 matrix products of GPT-2 small's training step through PyTorch (cuBLAS), at the vocabulary of
50,257 columns and padded to 50,264 (rows 16-byte aligned): what the misaligned output layer costs.

A measurement, not a test: run on a GPU machine (scripts/gpu_check.sh runs it). Prints one JSON line per
shape (milliseconds, the median of 20 timed runs after 5 warm-ups, and TFLOP/s).
"""

import json
import statistics

import torch


def time_ms(fn, warmup=5, runs=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    tokens, hidden = 8192, 768
    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    shapes = []
    for vocab in (50257, 50264):
        x = torch.randn(tokens, hidden, **bf)
        w = torch.randn(vocab, hidden, **bf)
        dl = torch.randn(tokens, vocab, **bf)
        shapes += [
            (f"logits x w^T vocab {vocab}", lambda x=x, w=w: x @ w.t(), tokens * vocab * hidden),
            (f"dx = dl w vocab {vocab}", lambda dl=dl, w=w: dl @ w, tokens * vocab * hidden),
            (f"dw = dl^T x vocab {vocab}", lambda dl=dl, x=x: dl.t() @ x, tokens * vocab * hidden),
        ]
    for n in (2304, 768, 3072):
        x = torch.randn(tokens, hidden, **bf)
        w = torch.randn(hidden, n, **bf)
        shapes.append((f"x w {tokens}x{hidden}x{n}", lambda x=x, w=w: x @ w, tokens * hidden * n))
    for name, fn, macs in shapes:
        ms = time_ms(fn)
        print(json.dumps({"gpu": torch.cuda.get_device_name(), "product": name, "ms": ms,
                          "tflops": 2 * macs / ms / 1e9}))


if __name__ == "__main__":
    main()
