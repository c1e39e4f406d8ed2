#!/usr/bin/env bash
# Creates .venv and installs the package with its test extras (idempotent).
# torch first: torch==$TORCH_VERSION when that is set; otherwise a torch already in .venv (e.g. the
# CUDA build you installed for real use) is kept, and without one torch==2.13.0 is installed (a
# local CPU build on this project's CI machines; an unpinned torch would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ -z "${TORCH_VERSION:-}" ] && .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup_env.sh: keeping torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') in .venv"
else
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[test]"
