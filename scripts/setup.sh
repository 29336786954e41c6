#!/usr/bin/env bash
# Sets up a fresh machine for nanoflash and (with --test) runs the CPU test suite.
#   bash scripts/setup.sh          # create .venv and install nanoflash with its test extras
#   bash scripts/setup.sh --test   # ... then run the README test command
# torch and triton (decided by scripts/platform.sh, which installs nothing; issue 38):
#   a torch that is already there -- the CUDA or ROCm build of a GPU image -- is kept, never replaced (.venv sees
#   the image's own through --system-site-packages, and pip is held to its version by a constraint);
#   no torch and an NVIDIA GPU: PyPI's torch (a CUDA build, bringing its own triton);
#   no torch and an AMD GPU: stop -- install a ROCm torch first (it brings pytorch-triton-rocm);
#   no torch and no GPU: torch==2.13.0 (a CPU wheel on the project's machines) and triton==3.6.0 for the
#   interpreter tests. triton is not a core dependency in pyproject.toml: ROCm's pytorch-triton-rocm provides the
#   same module, and pip would clobber it. torchvision is never installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -d .venv ]; then
  eval "$(bash scripts/platform.sh "$PY")"
  if [ "$SYSTEM_SITE" = 1 ]; then
    echo "setup: keeping $PY's $TORCH_FOUND torch (.venv made with --system-site-packages)"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
eval "$(bash scripts/platform.sh python)"
echo "setup: GPU=$GPU torch found=$TORCH_FOUND -> torch $TORCH, triton $TRITON"
case "$TORCH" in
  install-cpu) python -m pip install -q "torch==$TORCH_CPU_PIN" ;;
  install-cuda) python -m pip install -q torch ;;
  missing-rocm)
    echo "setup: error: an AMD GPU (ROCm) and no torch; PyPI's default torch is a CUDA/CPU build. Install a ROCm" \
         "torch first (the ROCm image's, or pip install torch --index-url https://download.pytorch.org/whl/rocm6.4)," \
         "then re-run" >&2
    exit 1 ;;
esac
if [ "$GPU" != none ] && [ "$TORCH_FOUND" = cpu ]; then
  echo "setup: warning: a $GPU GPU but torch is a CPU build; GPU recipes will refuse to start" >&2
fi
if [ "$TRITON" = install ]; then python -m pip install -q "triton==$TRITON_CPU_PIN"; fi
pin=$(mktemp)
python -c "import torch; print('torch==' + torch.__version__)" > "$pin"   # pip may not replace this torch
python -m pip install -q -c "$pin" -e ".[test,train]"
rm -f "$pin"
python -c "import torch, triton; print('torch', torch.__version__, torch.version.hip and 'rocm' or
                                      torch.cuda.is_available() and 'cuda' or 'cpu', '| triton', triton.__version__)"
if [ "${1:-}" = "--test" ]; then
  python -m pytest -q -x -n auto --dist loadscope --durations=15  # one worker per core, a module per worker
fi
echo "next (no activation needed): .venv/bin/python train.py --recipe demo    # or .venv/bin/python train.py --help"
