#!/usr/bin/env bash
# Create ./.venv and install shoal into it (idempotent).
# On machines without an NVIDIA GPU, torch==2.13.0 (the CPU wheel) is installed first so that
# pip does not pull a multi-GB CUDA build; on GPU machines the existing/CUDA torch is used.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/pip install -q "torch>=2.11"
  else
    .venv/bin/pip install -q torch==2.13.0
  fi
fi
stamp=.venv/.shoal-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q -e ".[test]"
  touch "$stamp"
fi
