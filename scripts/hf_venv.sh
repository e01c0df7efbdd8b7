#!/usr/bin/env bash
# Sourced by hf_compare.sh and bench_vs_torch.sh: makes (or reuses) the virtualenv with torch, tiktoken,
# transformers, safetensors and numpy, installing only what does not import yet, and sets PY to its
# interpreter. See hf_compare.sh for why the ordinary PyPI torch is installed.
#
# Environment:
#   PYTHON        interpreter used to create the venv (default: python3)
#   HF_VENV       venv location (default: ~/.cache/optimus/venv-hf, shared by every clone on this machine)

VENV=${HF_VENV:-$HOME/.cache/optimus/venv-hf}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating virtualenv $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# Which of the needed modules do not import yet?
missing=()
for mod in torch transformers safetensors numpy tiktoken; do
  if ! "$PY" -c "import $mod" >/dev/null 2>&1; then
    missing+=("$mod")
  fi
done

start=$(date +%s)
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing into $VENV: ${missing[*]}"
  "$PY" -m pip install "${missing[@]}"
else
  echo "== $VENV already has torch, transformers, safetensors, numpy"
fi
end=$(date +%s)
echo "== install took $((end - start)) s; $VENV is $(du -sh "$VENV" | cut -f1)"
"$PY" -c 'import torch, transformers, safetensors, numpy; print(f"== torch {torch.__version__}, transformers {transformers.__version__}, safetensors {safetensors.__version__}, numpy {numpy.__version__}")'
