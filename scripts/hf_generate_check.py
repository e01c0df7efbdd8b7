#!/usr/bin/env python3
"""Checks `optimusc generate` against Hugging Face's `generate`: greedy decoding must give exactly the
tokens of `model.generate(do_sample=False)` (float64) for GPT-2 and Llama with grouped-query attention,
several prompts of different lengths generated together, on one device, optimus 2x2 and 4x4 and
megatron 1x4, with the key/value cache (the default) and without it (`--no-cache`, on 2x2); and
sampling with a seed must give the same tokens on every mesh. GPT-2's model keeps its dropout of 0.1,
which inference must leave out as Hugging Face's eval mode does. The logit of every generated token must be within 1e-4 of
Hugging Face's float64 logit. Weights are drawn 15 times wider than Hugging Face's default,
so that the predictions are peaked and far from ties.

Usage: hf_generate_check.py --optimusc PATH
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
VOCAB, CONTEXT, NEW = 211, 48, 12
PROMPTS = [[5, 17, 99, 3], [42], [7, 7, 7, 120, 64, 200, 1, 9, 33]]
FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def gpt2():
    torch.manual_seed(5)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=4,
                        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        initializer_range=0.3, bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config)
    state = {f"transformer.{k}": v.contiguous() for k, v in model.transformer.state_dict().items()
             if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    flags = {"layers": 2, "hidden": 32, "heads": 4, "ffn": 128, "pdrop": 0.1}
    return "gpt2.opt", model, state, flags, "1x4"


def llama():
    torch.manual_seed(6)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=CONTEXT,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.3,
                         bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(config)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    flags = {"layers": 2, "hidden": 32, "heads": 8, "kv_heads": 4, "ffn": 48, "rope_theta": 10000.0, "eps": 1e-5}
    return "llama.opt", model, state, flags, "1x4"


def reference(model, prompt):
    """Hugging Face's greedy tokens (prompt and new) and the float64 logit of each new token."""
    model = model.double().eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             output_logits=True, return_dict_in_generate=True)
    ids = out.sequences[0].tolist()
    logits = [step[0, ids[len(prompt) + k]].item() for k, step in enumerate(out.logits)]
    return ids, logits


def ours(binary, name, weights, flags, mesh, strategy, extra=()):
    values = {**flags, "vocab": VOCAB, "context": CONTEXT}
    sets = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
    ids = [a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]
    cmd = [binary, "generate", str(REPO / "examples" / name), *sets, "--weights", str(weights), *ids,
           "--max-new-tokens", str(NEW), "--mesh", mesh, "--strategy", strategy, "--json", *extra]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        return None, result.stderr.strip()
    records = [json.loads(line) for line in result.stdout.splitlines()]
    return [(r["ids"], r["logits"]) for r in records], None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimusc", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        for name, model, state, flags, megatron in [gpt2(), llama()]:
            weights = Path(work) / f"{name}.safetensors"
            save_file(state, str(weights))
            expected = [reference(model, p) for p in PROMPTS]
            expected_ids = [ids for ids, _ in expected]
            sampled = {}
            runs = [("none", "1x1", ()), ("optimus", "2x2", ()), ("optimus", "4x4", ()), ("megatron", megatron, ()),
                    ("optimus", "2x2", ("--no-cache",))]
            for strategy, mesh, cache in runs:
                got, error = ours(args.optimusc, name, weights, flags, mesh, strategy, cache)
                mesh = f"{mesh}{' --no-cache' if cache else ''}"
                got_ids = [ids for ids, _ in got or []]
                check(got_ids == expected_ids, f"{name} {strategy} {mesh}: greedy tokens equal Hugging Face generate"
                      + (f" ({error})" if error else "" if got_ids == expected_ids else f": {got_ids} against {expected_ids}"))
                worst = max((abs(a - b) for (_, ours_l), (_, ref_l) in zip(got or [], expected)
                             for a, b in zip(ours_l, ref_l)), default=float("inf"))
                check(worst <= 1e-4, f"{name} {strategy} {mesh}: every step's logit within 1e-4 of float64 "
                      f"(worst {worst:.1e})")
                sample = ["--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--seed", "11"]
                sampled[mesh], error = ours(args.optimusc, name, weights, flags, mesh.split()[0], strategy,
                                            (*cache, *sample))
                check(error is None, f"{name} {strategy} {mesh}: sampled" + (f" ({error})" if error else ""))
            first = next(iter(sampled.values()))
            check(all(s is not None and [i for i, _ in s] == [i for i, _ in first] for s in sampled.values())
                  and [i for i, _ in first] != expected_ids,
                  f"{name}: seeded sampling gives the same tokens on every mesh, and not the greedy ones")
    print(f"{'FAILED' if FAILURES else 'passed'}: generate against Hugging Face")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
