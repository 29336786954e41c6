"""Fused mHC (Triton, `nanoflash.kernels.mhc`) against model.py's reference, forward and backward.

CPU: the kernels under Triton's interpreter (TRITON_INTERPRET=1, read when Triton is first imported, so the
cases run in ONE subprocess: this file run as a script), fp32 and bf16, sizes that leave ragged token and D
tiles, the dfn reduction split over several token ranges. GPU-marked: real width (M=4, D=4096) in bf16.
The reference is `model.hc_pre_reference` / `model.hc_post` (the Sinkhorn loop as the spec writes it).

Run: pytest tests/test_kernels_mhc.py -q ; on a GPU: pytest -m gpu tests/test_kernels_mhc.py -q
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

ITERS, EPS, NORM_EPS = 20, 1e-6, 1e-6  # the official Sinkhorn iterations and eps (flash config)
# fp32: the same arithmetic in another summation order (ieee dots over M*D, sums over D); measured <= 3e-6
# relative to each output's / gradient's largest value (x 2e-7, out 2.4e-7, grad fn 2.6e-7, grad scale 7.8e-7).
FP32_REL = 1e-5
# bf16 streams: outputs are rounded to bf16 (2^-8 relative) at slightly different values; the h gradient is
# summed in fp32 and rounded once (the reference rounds two partial sums to bf16 and adds them in bf16);
# measured <= 1.1e-2 relative (CPU case; 9.8e-3 on the H200 at real width) -> 2e-2.
BF16_REL = 2e-2
# post / comb (fp32 in [0, 2] and [0, 1]) after sigmoid / 20 Sinkhorn iterations of the mixes, a sum over
# M*D = 16384 products. fp32 streams: FMA dots, summation order only (6.9e-6 measured on the H200) -> 1e-5.
# bf16 streams on the GPU: the mixes run on bf16 tensor cores (fn split into three bf16 parts, products
# exact) whose fp32 accumulation is not IEEE: measured 5.6e-5 (vs 5.4e-6 with the FMA dot) -> 1e-4, 1/40 of
# a bf16 ulp at 1, far below the resolution of the bf16 streams these coefficients scale.
COEF_ABS = {torch.float32: 1e-5, torch.bfloat16: 1e-4}
INTERP_TIMEOUT_S = 240  # both cases take ~15 s on the 2-core CI box


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _inputs(B, S, M, D, dtype, device, gen):
    mix = (2 + M) * M
    h = torch.randn(B, S, M, D, generator=gen).to(device, dtype).requires_grad_()
    fn = (torch.randn(mix, M * D, generator=gen) * D ** -0.5).to(device).requires_grad_()
    scale = (torch.rand(3, generator=gen) + 0.5).to(device).requires_grad_()
    base = (torch.randn(mix, generator=gen) * 0.1).to(device).requires_grad_()
    return h, fn, scale, base


def _run(pre_fn, post_fn, args, seed):
    """hc_pre -> (x * 1.5 for the sublayer) -> hc_post, a seeded random cotangent; -> outputs, grads."""
    h, fn, scale, base = args
    x, post, comb = pre_fn(h, fn, scale, base, h.shape[2], ITERS, EPS, NORM_EPS)
    out = post_fn(x * 1.5, h, post, comb)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g).to(out.device)
    (out.float() * w).sum().backward()
    grads = {n: a.grad.clone() for n, a in zip(("h", "fn", "scale", "base"), args)}
    for a in args:
        a.grad = None
    return {"x": x, "post": post, "comb": comb, "out": out}, grads


def _compare(dtype, B, S, D, seed):
    """Errors of the fused kernels against the reference: {name: relative (or absolute for post/comb)}."""
    from nanoflash.kernels.mhc import hc_post_fused, hc_pre_fused
    from nanoflash.model import hc_post, hc_pre_reference
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args = _inputs(B, S, 4, D, dtype, dev, torch.Generator().manual_seed(seed))
    ref, gref = _run(hc_pre_reference, hc_post, args, seed + 1)
    got, ggot = _run(hc_pre_fused, hc_post_fused, args, seed + 1)
    errs = {k: rel(got[k], ref[k]) for k in ("x", "out")}
    errs.update({k: float((got[k] - ref[k]).abs().max()) for k in ("post", "comb")})
    errs.update({f"grad_{k}": rel(ggot[k], gref[k]) for k in gref})
    return errs


def _check(errs, dtype):
    tol = FP32_REL if dtype == torch.float32 else BF16_REL
    for k, e in errs.items():
        bound = COEF_ABS[dtype] if k in ("post", "comb") else tol
        assert e <= bound, f"{k}: {e:.3e} > {bound:.1e} ({errs})"


# ------------------------------------------------------------------------------------------ interpreter run
CASES = {"fp32": (torch.float32, 2, 5, 48, 0), "bf16": (torch.bfloat16, 1, 9, 80, 3)}


def _interpreter_main(out_path):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from interp import patch_interpreter      # tests/interp.py: Triton 3.6 interpreter fixes, shared
    patch_interpreter()
    from nanoflash.kernels import mhc
    mhc.DFN_MIN_TOKENS = 4            # several token splits of the dfn reduction at these sizes
    res = {name: _compare(*case) for name, case in CASES.items()}
    with open(out_path, "w") as f:
        json.dump(res, f)


@pytest.fixture(scope="module")
def interp():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "out.json")
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), path], env=env, capture_output=True,
                              text=True, timeout=INTERP_TIMEOUT_S)
        if proc.returncode:
            pytest.fail(f"interpreter subprocess failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(path) as f:
            return json.load(f)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_mhc_equals_reference_interpreter(interp, case):
    _check(interp[case], CASES[case][0])


def test_fused_mhc_rejects_bad_streams():
    from nanoflash.kernels.mhc import hc_pre_fused
    h = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match="M = hc_mult"):
        hc_pre_fused(h, torch.zeros(15, 24), torch.ones(3), torch.zeros(15), 3, ITERS, EPS, NORM_EPS)


@pytest.mark.gpu
def test_fused_mhc_equals_reference_gpu_real_width():
    errs = _compare(torch.bfloat16, 1, 2048, 4096, 7)
    print("mhc errors (relative; post/comb absolute)", errs)
    _check(errs, torch.bfloat16)
    errs32 = _compare(torch.float32, 1, 1000, 4096, 8)   # ragged token tile; fp32 streams
    print("mhc fp32 errors", errs32)
    _check(errs32, torch.float32)


if __name__ == "__main__":
    _interpreter_main(sys.argv[1])
