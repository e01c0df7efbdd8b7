#!/usr/bin/env python3
"""Checks `optimusc tokenize` against OpenAI's tiktoken and Hugging Face's tokenizers, id for id.

- Built-in GPT-2: the token files must equal tiktoken's GPT-2 encoding (`encode_ordinary`, documents
  joined with <|endoftext|>) and Hugging Face's GPT2TokenizerFast. Neither library can download its
  files here, so both are built from the files the tiktoken-rs crate ships (r50k_base.tiktoken, and
  GPT-2's encoder.json and vocab.bpe), after checking r50k_base.tiktoken's and vocab.bpe's SHA-256
  against the hashes tiktoken itself expects of OpenAI's downloads (the same files, not copies of our
  own), and that encoder.json with vocab.bpe gives those ranks.
- `run --save-weights DIR/ --tokenizer gpt2`: the tokenizer.json written there holds GPT-2's vocabulary and
  merges (as Hugging Face builds them from the original files), and AutoTokenizer.from_pretrained(DIR)
  encodes as tiktoken.
- Any tokenizer.json: GPT-2's as Hugging Face saves it; a WordPiece tokenizer (BERT's normaliser and
  pre-tokeniser, [SEP] between documents); and a byte-level BPE with Llama 3's pre-tokenising pattern
  and more than 65,535 tokens (a u32 file). Each must equal `Tokenizer.encode(text,
  add_special_tokens=False)`.

Texts: Unicode of several scripts and emoji, runs of spaces, tabs and blank lines, CRLF, control
characters, digits, contractions, and a corpus of several megabytes (cut into pieces by optimusc), in
plain files and a .jsonl file, with and without --val-fraction. Usage:
hf_tokenize_compare.py --optimusc PATH --assets TIKTOKEN_RS_ASSETS_DIR
"""

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks, load_tiktoken_bpe
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer

# What tiktoken expects of OpenAI's downloads (tiktoken_ext/openai_public.py).
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

REPO = Path(__file__).resolve().parent.parent
FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def awkward_texts():
    """Short texts with everything a pre-tokeniser can trip on."""
    return [
        "Hello world! It's a test, isn't it? We'll see; they'd've known.",
        "naïve café — 東京 and Ελληνικά, emoji 🙂👍🏽 and combining e\u0301 marks",
        "  leading spaces, trailing spaces   \n\n\n\tTabs\t\there  and\u00a0no-break\u2003em space",
        "CRLF lines\r\nsecond\r\n\r\nthird \r\n",
        "control \x00 \x01 \x07 \x1b[31m characters \x7f and \u200b zero width",
        "numbers 1234567 3.14159 1,000,000 2026-11-26 0x1F",
        "code: fn main() { let x = vec![1, 2, 3]; println!(\"{x:?}\"); }\n    indented\n",
    ]


def long_text(seed, size):
    """A text of about `size` bytes mixing words, digits, Unicode, newlines and whitespace runs."""
    rng = random.Random(seed)
    words = ["the", "model", "naïve", "東京", "Ελληνικά", "🙂", "it's", "1234", "3.5", "--", "a\tb", "x", "GPT"]
    seps = [" ", " ", " ", "  ", "\n", "\n\n", "\t", ", ", ". ", "\r\n", " \n"]
    parts, length = [], 0
    while length < size:
        part = rng.choice(words) + rng.choice(seps)
        parts.append(part)
        length += len(part.encode())
    return "".join(parts)


def write(directory, name, text):
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    return path


def tokenize(optimusc, files, prefix, extra=()):
    result = subprocess.run([optimusc, "tokenize", *files, "-o", prefix, *extra], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"optimusc tokenize failed:\n{result.stderr}")
    with open(prefix + ".json") as f:
        sidecar = json.load(f)
    dtype = np.uint32 if sidecar["dtype"] == "u32" else np.uint16
    train = np.fromfile(sidecar["train"]["path"], dtype=dtype).tolist()
    val = np.fromfile(sidecar["val"]["path"], dtype=dtype).tolist() if sidecar["val"] else []
    return sidecar, train, val


def joined(documents, encode, separator):
    ids = []
    for k, doc in enumerate(documents):
        if k > 0:
            ids.append(separator)
        ids.extend(encode(doc))
    return ids


def compare_documents(optimusc, directory, name, documents, encode, separator, extra=()):
    """Writes each document as a file, tokenizes them with optimusc, compares with `encode`."""
    files = [write(directory, f"{name}-{k}.txt", doc) for k, doc in enumerate(documents)]
    sidecar, train, val = tokenize(optimusc, files, os.path.join(directory, name), extra)
    expected = joined(documents, encode, separator)
    check(train + val == expected, f"{name}: {len(expected)} ids equal, {len(documents)} documents")
    check(sidecar["tokens"] == len(expected) and sidecar["documents"] == len(documents), f"{name}: sidecar counts")
    return sidecar, train, val, expected


def gpt2_checks(optimusc, assets, directory):
    r50k = os.path.join(assets, "r50k_base.tiktoken")
    encoder_json, vocab_bpe = os.path.join(assets, "encoder.json"), os.path.join(assets, "vocab.bpe")
    check(sha256(r50k) == R50K_SHA256, "r50k_base.tiktoken is OpenAI's (tiktoken's expected SHA-256)")
    check(sha256(vocab_bpe) == VOCAB_BPE_SHA256, "vocab.bpe is OpenAI's GPT-2 file")
    ranks = load_tiktoken_bpe(r50k)
    # The crate's encoder.json is laid out differently from OpenAI's (another hash); what it maps must
    # give r50k_base's ranks with vocab.bpe, as tiktoken's own gpt2 encoding derives them.
    check(ranks == data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json), "encoder.json and vocab.bpe give r50k_base's ranks")
    enc = tiktoken.Encoding("gpt2", pat_str=R50K_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)
    hf = gpt2_hugging_face(encoder_json, vocab_bpe)
    texts = awkward_texts()
    for k, text in enumerate(texts):
        check(enc.encode_ordinary(text) == hf.encode(text).ids, f"tiktoken and Hugging Face agree on text {k}")
    # Every awkward text as one document each, then as one file; a literal <|endoftext|> is ordinary text.
    compare_documents(optimusc, directory, "gpt2-docs", texts, enc.encode_ordinary, 50256)
    compare_documents(optimusc, directory, "gpt2-literal", ["a <|endoftext|> b"], enc.encode_ordinary, 50256)
    # Several megabytes: cut into pieces by optimusc, with a validation share.
    big = [long_text(1, 3_000_000), long_text(2, 1_500_000)]
    sidecar, train, val, expected = compare_documents(
        optimusc, directory, "gpt2-big", big, enc.encode_ordinary, 50256, ["--val-fraction", "0.1"])
    check(len(val) == round(0.1 * len(expected)) and sidecar["val"]["tokens"] == len(val), "gpt2-big: 10% to val")
    check(hf.encode(big[0]).ids == enc.encode_ordinary(big[0]), "gpt2-big: Hugging Face agrees on 3 MB")
    # JSON Lines: one document per line.
    lines = [json.dumps({"text": t}) for t in texts]
    path = write(directory, "gpt2.jsonl", "\n".join(lines) + "\n")
    _, train, _ = tokenize(optimusc, [path], os.path.join(directory, "gpt2-jsonl"))
    check(train == joined(texts, enc.encode_ordinary, 50256), "gpt2 .jsonl: one document per line")
    # The same through GPT-2's tokenizer.json as Hugging Face saves it.
    json_path = os.path.join(directory, "gpt2-tokenizer.json")
    hf.save(json_path)
    compare_documents(optimusc, directory, "gpt2-json", texts + big[:1], lambda t: hf.encode(t).ids, 50256,
                      ["--tokenizer", json_path])
    # `run --save-weights DIR/ --tokenizer gpt2`: AutoTokenizer opens the folder, with GPT-2's own vocabulary and
    # merges, and encodes as tiktoken.
    model_dir = os.path.join(directory, "gpt2-model")
    small = ["--set", "layers=1", "--set", "hidden=16", "--set", "heads=2", "--set", "vocab=50257", "--set", "seq=8",
             "--set", "context=16", "--set", "batch=2"]
    subprocess.run([optimusc, "run", str(REPO / "examples" / "gpt2.opt"), *small, "--steps", "1", "--save-weights",
                    model_dir + "/", "--tokenizer", "gpt2"], check=True, capture_output=True)
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        ours = json.load(f)["model"]
    reference = json.loads(hf.to_str())["model"]
    check(ours["vocab"] == reference["vocab"], "saved gpt2 tokenizer.json: GPT-2's vocabulary")
    as_pairs = lambda merges: [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]  # noqa: E731
    check(as_pairs(ours["merges"]) == as_pairs(reference["merges"]), "saved gpt2 tokenizer.json: GPT-2's 50,000 merges in order")
    auto = AutoTokenizer.from_pretrained(model_dir)
    check(all(auto.encode(t) == enc.encode_ordinary(t) for t in texts), "AutoTokenizer on the saved folder encodes as tiktoken")
    check(auto.eos_token == "<|endoftext|>", "the saved folder's end-of-text token")


def gpt2_hugging_face(encoder_json, vocab_bpe):
    """GPT-2's tokenizer as Hugging Face builds it from the two original files (its tokenizer.json):
    byte-level BPE without a prefix space, <|endoftext|> an added special token."""
    tok = Tokenizer(models.BPE.from_file(encoder_json, vocab_bpe))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


def train_wordpiece(corpus):
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=2000, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.train_from_iterator(corpus, trainer)
    return tok


def train_llama3_like(corpus):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=__import__("tokenizers").Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=3000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|begin_of_text|>", "<|end_of_text|>"])
    tok.train_from_iterator(corpus, trainer)
    # Reserved tokens past 65,535, as Llama 3 has (128,256): the files must be u32.
    tok.add_special_tokens([f"<|reserved_{k}|>" for k in range(66_000 - tok.get_vocab_size())])
    return tok


def json_tokenizer_checks(optimusc, directory):
    texts = awkward_texts()
    corpus = texts + [long_text(3, 200_000)]
    for name, tok, separator, dtype in [
        ("wordpiece", train_wordpiece(corpus), "[SEP]", "u16"),
        ("llama3-like", train_llama3_like(corpus), "<|end_of_text|>", "u32"),
    ]:
        # Not NAME.json: that is the sidecar of the token files tokenize writes under the prefix NAME.
        path = os.path.join(directory, f"{name}.tokenizer.json")
        tok.save(path)
        encode = lambda text, tok=tok: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
        documents = texts + [long_text(4, 2_500_000)]
        sidecar, *_ = compare_documents(optimusc, directory, name, documents, encode, tok.token_to_id(separator),
                                        ["--tokenizer", path])
        check(sidecar["dtype"] == dtype and sidecar["vocab_size"] == tok.get_vocab_size(),
              f"{name}: {dtype} files for {tok.get_vocab_size()} tokens")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimusc", required=True)
    parser.add_argument("--assets", required=True, help="tiktoken-rs's assets folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        gpt2_checks(args.optimusc, args.assets, directory)
        json_tokenizer_checks(args.optimusc, directory)
    print(f"{'FAILED' if FAILURES else 'passed'}: tokenize against tiktoken and tokenizers")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
