#!/usr/bin/env bash
# What scripts/setup.sh installs on this machine: prints KEY=value lines for `eval`, installs nothing.
#   bash scripts/platform.sh [PYTHON]     # PYTHON: the interpreter whose torch is probed (default python3)
#
#   GPU=nvidia|amd|none    nvidia-smi -L lists a GPU -> nvidia; rocm-smi / amd-smi answers, $NANOFLASH_ROCM_DIR
#                          (default /opt/rocm) exists, or the torch found is a ROCm build -> amd
#   TORCH_FOUND=cuda|rocm|cpu|none   the torch PYTHON imports (torch.version.hip / .cuda)
#   TORCH=keep             a torch is there: never replaced (a CUDA or ROCm build came with the machine's image)
#         install-cuda     NVIDIA GPU, no torch: PyPI's torch (a CUDA build that brings its own triton)
#         install-cpu      no GPU, no torch: torch==$TORCH_CPU_PIN (a CPU wheel on the project's machines)
#         missing-rocm     AMD GPU, no torch: refuse -- PyPI's default torch is a CUDA/CPU build; a ROCm torch
#                          (and its pytorch-triton-rocm) comes from the ROCm image or download.pytorch.org/whl/rocm*
#   TRITON=install|keep    install triton==$TRITON_CPU_PIN only for a CPU torch (the interpreter tests need it; CUDA
#                          torch brings triton, ROCm torch brings pytorch-triton-rocm, which triton would clobber)
#   SYSTEM_SITE=1|0        1: PYTHON's own torch is a GPU build -> make .venv with --system-site-packages to keep it
#
# tests/test_setup_platform.py runs this with a fake torch on PYTHONPATH and fake *-smi on PATH (issue 38).
set -uo pipefail
PY=${1:-python3}
TORCH_CPU_PIN=2.13.0    # the CI / CPU machines' torch (a CPU wheel on local disk there)
TRITON_CPU_PIN=3.6.0    # the interpreter the CPU kernel tests are written against (tests/interp.py patches it)
ROCM_DIR=${NANOFLASH_ROCM_DIR:-/opt/rocm}

found=$("$PY" -c 'import torch
print("rocm" if getattr(torch.version, "hip", None) else "cuda" if getattr(torch.version, "cuda", None) else "cpu")' \
  2>/dev/null) || found=none

gpu=none
if command -v nvidia-smi >/dev/null 2>&1 && smi=$(nvidia-smi -L 2>/dev/null) && [[ $smi == *GPU* ]]; then
  gpu=nvidia
elif { command -v rocm-smi >/dev/null 2>&1 && rocm-smi >/dev/null 2>&1; } \
     || { command -v amd-smi >/dev/null 2>&1 && amd-smi list >/dev/null 2>&1; } \
     || [ -d "$ROCM_DIR" ] || [ "$found" = rocm ]; then
  gpu=amd
fi

case "$found:$gpu" in
  none:nvidia) torch=install-cuda ;;
  none:amd) torch=missing-rocm ;;
  none:none) torch=install-cpu ;;
  *) torch=keep ;;
esac
if [ "$torch" = install-cpu ] || [ "$found" = cpu ]; then triton=install; else triton=keep; fi
if [ "$found" = cuda ] || [ "$found" = rocm ]; then site=1; else site=0; fi
echo "GPU=$gpu"
echo "TORCH_FOUND=$found"
echo "TORCH=$torch"
echo "TRITON=$triton"
echo "SYSTEM_SITE=$site"
echo "TORCH_CPU_PIN=$TORCH_CPU_PIN"
echo "TRITON_CPU_PIN=$TRITON_CPU_PIN"
