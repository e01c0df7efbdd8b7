#!/usr/bin/env bash
# Checks examples/gpt2.opt against Hugging Face's GPT2LMHeadModel, examples/llama.opt against
# LlamaForCausalLM in float64 (scripts/hf_llama_compare.py: grouped-query and full attention, a vocabulary
# no mesh divides, one-file and sharded save_pretrained checkpoints, SGD and AdamW, four meshes), and
# examples/bert.opt against BertForMaskedLM in float64 (scripts/hf_bert_compare.py: the MLM objective with
# token types and ignored labels, the tied decoder, square and non-square linears, SGD and AdamW, four meshes),
# what `--save-weights DIR/` writes against from_pretrained (scripts/hf_export_check.py), `optimusc eval`'s
# perplexity against Hugging Face's (scripts/hf_eval_check.py), `optimusc generate`'s greedy tokens against
# Hugging Face's generate (scripts/hf_generate_check.py), and `optimusc
# tokenize` against tiktoken's and Hugging Face tokenizers' ids (scripts/hf_tokenize_compare.py).
#
# 1. Makes (or reuses) a virtualenv (see HF_VENV) and pip-installs torch,
#    transformers, safetensors and numpy into it, each only if it does not
#    import yet; prints how long that took and how large the venv is.
# 2. Builds optimusc in release mode, with the mpi feature (Open MPI: scripts/test.sh installs it).
# 3. Runs scripts/hf_compare.py, which trains the same small GPT-2 from the
#    same weights on the same tokens in PyTorch and in `optimusc run` (SGD with
#    momentum and AdamW with weight decay; meshes none 1x1, optimus 2x2 and
#    4x4, megatron 1x4, tesseract 2x2x2 and 3d 2x2x2, and at batch 8 tesseract 4x2x2 and 2x2x2x2 and 3d 2x2x2x2) and compares every step's loss and every updated weight.
#
# Idempotent: a second run installs nothing. Extra arguments go to
# hf_compare.py (try --help). The exit code is non-zero if either comparison fails.
#
# Environment:
#   PYTHON        interpreter used to create the venv (default: python3)
#   HF_VENV       venv location (default: ~/.cache/optimus/venv-hf, shared by every clone on this machine)
#
# About the install: PyPI has no CPU-only torch wheel for Linux x86_64 (that
# lives on PyTorch's own index, which is not reachable here), and the PyPI wheel
# cannot even be imported without its nvidia-* packages (`pip install --no-deps
# torch` fails at `import torch`: libcudart.so.13 not found). So this installs
# the ordinary PyPI torch: about 2 minutes and 5.6 GB for the whole venv
# (torch 1.2 GB, triton 1 GB, nvidia-* 3.1 GB), once.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/hf_venv.sh
source scripts/hf_venv.sh

echo "== cargo build --release --features mpi (the pipelines under mpirun below need it)"
cargo build --release --features mpi --bin optimusc

OPTIMUSC="${CARGO_TARGET_DIR:-target}/release/optimusc"
echo "== comparing examples/gpt2.opt with GPT2LMHeadModel"
status=0
"$PY" scripts/hf_compare.py --optimusc "$OPTIMUSC" "$@" || status=$?
echo "== examples/gpt2.opt against GPT2LMHeadModel on tesseract depth 4 and 3d with replicas (batch 8)"
"$PY" scripts/hf_compare.py --optimusc "$OPTIMUSC" --batch 8 --optimizers sgd,adamw-all \
    --meshes none:1x1,tesseract:4x2x2,tesseract:2x2x2x2,3d:2x2x2x2 || status=$?
echo "== examples/gpt2.opt against GPT2LMHeadModel as pipelines (4 layers: GPipe, 1F1B, interleaved; meshes, replicas)"
"$PY" scripts/hf_compare.py --optimusc "$OPTIMUSC" --layers 4 --optimizers adamw-all,sgd-accum2 \
    --meshes none:1x1:pp4-gpipe,optimus:2x2:pp2-1f1b,megatron:1x2:pp2-interleaved,none:2x1x1:pp2-1f1b,optimus:2x2x2:pp4-1f1b,megatron:2x1x2:pp2-gpipe \
    || status=$?
echo "== the same pipelines under mpirun, one process per device of every stage (4 to 16 processes)"
"$PY" scripts/hf_compare.py --optimusc "$OPTIMUSC" --layers 4 --optimizers adamw-all,sgd-accum2 \
    --meshes none:1x1:pp4-gpipe-mpi,optimus:2x2:pp2-1f1b-mpi,megatron:1x2:pp2-interleaved-mpi,none:2x1x1:pp2-1f1b-mpi,optimus:2x2x2:pp2-interleaved-mpi,megatron:2x1x2:pp4-gpipe-mpi \
    || status=$?
echo "== comparing examples/llama.opt with LlamaForCausalLM (float64)"
"$PY" scripts/hf_llama_compare.py --optimusc "$OPTIMUSC" || status=$?
echo "== comparing examples/bert.opt with BertForMaskedLM (float64)"
"$PY" scripts/hf_bert_compare.py --optimusc "$OPTIMUSC" || status=$?
echo "== opening --save-weights DIR/ with from_pretrained (GPT-2, Llama, BERT)"
"$PY" scripts/hf_export_check.py --optimusc "$OPTIMUSC" || status=$?
echo "== comparing optimusc generate with Hugging Face generate (greedy, float64)"
"$PY" scripts/hf_generate_check.py --optimusc "$OPTIMUSC" || status=$?
echo "== comparing optimusc eval with Hugging Face perplexity (float64)"
"$PY" scripts/hf_eval_check.py --optimusc "$OPTIMUSC" || status=$?
echo "== comparing optimusc tokenize with tiktoken and Hugging Face tokenizers"
ASSETS="$(cargo metadata --format-version 1 | "$PY" -c 'import json, os, sys; print(next(os.path.join(os.path.dirname(p["manifest_path"]), "assets") for p in json.load(sys.stdin)["packages"] if p["name"] == "tiktoken-rs"))')"
"$PY" scripts/hf_tokenize_compare.py --optimusc "$OPTIMUSC" --assets "$ASSETS" || status=$?
exit "$status"
