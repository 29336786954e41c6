#!/usr/bin/env bash
# Sets up a fresh machine for nanoflash and (with --test) runs the CPU test suite.
#   bash scripts/setup.sh          # create .venv and install nanoflash with its test extras
#   bash scripts/setup.sh --test   # ... then run the README test command
# torch: a CUDA machine keeps (or gets) the CUDA build; a machine without a GPU pins torch==2.13.0,
# which is a CPU wheel on the project's machines. torchvision is never installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  python -c "import torch" 2>/dev/null || python -m pip install -q torch
else
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[test,train]"
python -c "import torch; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
if [ "${1:-}" = "--test" ]; then
  python -m pytest -q -x --durations=15
fi
echo "next (no activation needed): .venv/bin/python train.py --recipe demo    # or .venv/bin/python train.py --help"
