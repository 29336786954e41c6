"""The GPU a kernel launch compiles for, and the choices that depend on it: tl.dot precisions, launch configs.

Triton checks `tl.dot(input_precision=...)` against the target: CUDA allows tf32, tf32x3, ieee, bf16x3, bf16x6;
Triton 3.6's AMD backend allows ieee, bf16x3, bf16x6, plus tf32 on gfx942 only -- "tf32" fails to compile on
gfx950 (MI355X). The precision only matters for fp32 operands; bf16 / fp16 operands run on the tensor cores
(wgmma / MFMA) whatever it says. So:

    dot_precision(dtype, target)   fp32 -> "ieee" (exact fp32 FMA dots, the tests' reference path) everywhere;
                                   bf16 / fp16 -> "tf32" on CUDA and the CPU interpreter (as before issue 38,
                                   bit-identical H200 kernels), "ieee" on AMD (legal on every gfx; MFMA still)
    split_fp32_precision(target)   fp32 operands on the tensor cores at ~fp32 accuracy (mhc's dh): "tf32x3" on
                                   CUDA; "bf16x6" on AMD (a 3-way bf16 split, >= tf32x3's 2 x 11 bits)

`device_target(device)` -> GPUTarget("cuda", 90, 32) on an H200, GPUTarget("hip", "gfx950", 64) on an MI355X,
None off the GPU (CPU / TRITON_INTERPRET=1: the CUDA choices, so the interpreter tests run what H200 runs).
ROCm builds of torch call the GPU "cuda" too (`tensor.is_cuda` is True), hence torch.version.hip here.
tests/test_kernels_compile_targets.py compiles every kernel for cuda:90, hip:gfx942 and hip:gfx950 on the CPU.
"""
from __future__ import annotations

import functools

import torch
from triton.backends.compiler import GPUTarget

WAVE_AMD = 64   # lanes per wavefront on CDNA (gfx9xx); num_warps=8 is 8 x 64 lanes there


@functools.cache
def _cuda_target(index: int) -> GPUTarget:
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]   # "gfx950:sramecc+:xnack-"
        return GPUTarget("hip", arch, WAVE_AMD)
    major, minor = torch.cuda.get_device_capability(index)
    return GPUTarget("cuda", major * 10 + minor, 32)


def device_target(device) -> GPUTarget | None:
    """The Triton target of tensors on `device`; None off the GPU (CPU, meta, the interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


def is_amd(target: GPUTarget | None) -> bool:
    return target is not None and target.backend == "hip"


def dot_precision(dtype: torch.dtype, target: GPUTarget | None) -> str:
    """input_precision of a tl.dot on `dtype` operands, legal on `target` (see the module docstring)."""
    if dtype == torch.float32:
        return "ieee"
    return "ieee" if is_amd(target) else "tf32"


def split_fp32_precision(target: GPUTarget | None) -> str:
    """fp32 operands on the tensor cores at ~fp32 accuracy: tf32x3 (CUDA), bf16x6 (AMD: no tf32x3 there)."""
    return "bf16x6" if is_amd(target) else "tf32x3"
