#!/usr/bin/env python3
"""Checks `optimusc eval` against Hugging Face in float64: the mean loss and perplexity over a whole token
file, with windows side by side (the default stride) and overlapping (stride below seq, Hugging Face's
sliding-window perplexity: each window counts only the targets the earlier ones did not), for GPT-2 and
Llama with grouped-query attention on one device, optimus 2x2 and megatron (1x4, Llama 1x2), with a file whose length
leaves a partial last window and a partial last batch. Perplexity must agree within 1e-5 relative.

The reference evaluates the same windows: window k starts at k * stride while a whole window (seq + 1
tokens) fits, then one window ends at the file's end; every token after the first is predicted once.

Usage: hf_eval_check.py --optimusc PATH
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
VOCAB, SEQ, BATCH, CONTEXT, TOKENS = 211, 16, 4, 32, 1013
# Weights drawn 15 times wider than Hugging Face's default, so that the predictions are far from uniform
# and the perplexity far from the vocabulary's size.
FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def gpt2():
    torch.manual_seed(3)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=4,
                        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        initializer_range=0.3, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = GPT2LMHeadModel(config)
    state = {f"transformer.{k}" if not k.startswith("lm_head") else k: v.contiguous()
             for k, v in model.transformer.state_dict().items() if not k.endswith(".attn.bias")}
    flags = {"layers": 2, "hidden": 32, "heads": 4, "ffn": 128, "pdrop": 0}
    return "gpt2.opt", model, {k: v for k, v in state.items() if "masked_bias" not in k}, flags


def llama():
    torch.manual_seed(4)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.3,
                         bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(config)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    flags = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 48, "rope_theta": 10000.0, "eps": 1e-5}
    return "llama.opt", model, state, flags


def windows(tokens, seq, stride):
    out, counted, start = [], 0, 0
    while start + seq < tokens:
        out.append((start, max(0, counted - start)))
        counted = start + seq
        start += stride
    if counted < tokens - 1:
        start = tokens - 1 - seq
        out.append((start, counted - start))
    return out


def reference(model, data, seq, stride):
    model = model.double().eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start, skip in windows(len(data), seq, stride):
            x = torch.tensor(data[start:start + seq + 1].astype(np.int64))
            logits = model(input_ids=x[None, :seq]).logits[0]
            nll = F.cross_entropy(logits[skip:], x[1 + skip:], reduction="sum")
            total += nll.item()
            count += seq - skip
    assert count == len(data) - 1
    return total / count


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimusc", required=True)
    args = parser.parse_args()
    data = np.random.default_rng(11).integers(0, VOCAB, size=TOKENS, dtype=np.uint16)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        data_path = work / "tokens.u16"
        data.tofile(data_path)
        for name, model, state, flags in [gpt2(), llama()]:
            weights = work / f"{name}.safetensors"
            save_file(state, str(weights))
            values = {**flags, "vocab": VOCAB, "seq": SEQ, "context": CONTEXT, "batch": BATCH}
            sets = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
            for stride in [SEQ, SEQ // 4]:
                expected = reference(model, data, SEQ, stride)
                # Llama's two key/value heads split at most two ways on megatron.
                megatron = "1x4" if name == "gpt2.opt" else "1x2"
                for strategy, mesh in [("none", "1x1"), ("optimus", "2x2"), ("megatron", megatron)]:
                    cmd = [args.optimusc, "eval", str(REPO / "examples" / name), *sets, "--mesh", mesh,
                           "--strategy", strategy, "--weights", str(weights), "--data", str(data_path),
                           "--stride", str(stride), "--json"]
                    result = subprocess.run(cmd, capture_output=True, text=True)
                    if result.returncode != 0:
                        check(False, f"{name} {strategy} {mesh} stride {stride}: {result.stderr.strip()}")
                        continue
                    record = json.loads(result.stdout)
                    rel = abs(record["perplexity"] - math.exp(expected)) / math.exp(expected)
                    check(rel <= 1e-5 and record["tokens"] == TOKENS - 1,
                          f"{name} {strategy} {mesh} stride {stride}: perplexity {record['perplexity']:.6f} ours, "
                          f"{math.exp(expected):.6f} Hugging Face float64 (relative {rel:.1e})")
    print(f"{'FAILED' if FAILURES else 'passed'}: eval against Hugging Face perplexity")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
