"""Fused (compiled) mHC against model.py's reference, forward and backward.

CPU: the dynamo + AOTAutograd graphs of `nanoflash.kernels.mhc` (backend aot_eager: inductor's C++ build takes
minutes on 2 cores) on two sequence lengths through one dynamic graph. GPU-marked: inductor at real width
(M=4, D=4096) in bf16, the path training takes.

Run: pytest tests/test_kernels_mhc.py -q ; on a GPU: pytest -m gpu tests/test_kernels_mhc.py -q
"""
import pytest
import torch

from nanoflash.kernels.mhc import compiled
from nanoflash.model import hc_post, hc_pre_reference

ITERS, EPS, NORM_EPS = 20, 1e-6, 1e-6  # the official Sinkhorn iterations and eps (flash config)
# aot_eager runs the same forward ops as eager after tracing: exact. Its backward is AOTAutograd's own
# decomposition (e.g. the einsum's transposes in another order): fp32 rounding, observed 1.1e-7 relative to
# the gradient's scale; bound 1e-6 relative.
CPU_ATOL, CPU_GRAD_RTOL = 0.0, 1e-6
# inductor on the GPU reorders fp32 reductions (over M*D = 16384 for the mixes) and rounds to bf16 at other
# points: bf16 outputs (x, the mixed streams) within 2 bf16 ulps of their scale (2 * 2^-8 relative; observed
# 0.016 at |x| ~ 4 and 0.0625 at |out| ~ 16, one ulp each); post / comb are fp32 after 20 normalisations ->
# 1e-5 absolute (observed 3.6e-7). Gradients: 2e-2 relative to their scale.
GPU_TOL = {"bf16_rel": 2 * 2 ** -8, "post": 1e-5, "comb": 1e-5, "grad": 2e-2}


def _inputs(B, S, M, D, dtype, device, gen):
    mix = (2 + M) * M
    h = torch.randn(B, S, M, D, generator=gen).to(device, dtype).requires_grad_()
    fn = (torch.randn(mix, M * D, generator=gen) * D ** -0.5).to(device).requires_grad_()
    scale = (torch.rand(3, generator=gen) + 0.5).to(device).requires_grad_()
    base = (torch.randn(mix, generator=gen) * 0.1).to(device).requires_grad_()
    return h, fn, scale, base


def _run(pre_fn, post_fn, args, gen_seed):
    h, fn, scale, base = args
    M = h.shape[2]
    x, post, comb = pre_fn(h, fn, scale, base, M, ITERS, EPS, NORM_EPS)
    out = post_fn(x * 1.5, h, post, comb)  # x * 1.5 stands in for the sublayer
    g = torch.Generator().manual_seed(gen_seed)
    w = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    (out.float() * w.float()).sum().backward()
    grads = [a.grad.clone() for a in args]
    for a in args:
        a.grad = None
    return {"x": x, "post": post, "comb": comb, "out": out}, grads


def test_compiled_mhc_equals_reference_cpu(gen):
    pre_c, post_c = compiled("aot_eager")
    for S in (5, 9):  # two lengths, one dynamic graph
        args = _inputs(2, S, 4, 16, torch.float32, "cpu", gen)
        ref, gref = _run(hc_pre_reference, hc_post, args, 1)
        got, ggot = _run(pre_c, post_c, args, 1)
        for k in ref:
            assert (got[k] - ref[k]).abs().max() <= CPU_ATOL, k
        for a, b in zip(ggot, gref):
            assert (a - b).abs().max() <= CPU_GRAD_RTOL * b.abs().max()


@pytest.mark.gpu
def test_compiled_mhc_equals_reference_gpu_real_width(gen):
    pre_c, post_c = compiled("inductor")
    args = _inputs(1, 2048, 4, 4096, torch.bfloat16, "cuda", gen)
    ref, gref = _run(hc_pre_reference, hc_post, args, 1)
    got, ggot = _run(pre_c, post_c, args, 1)
    errs = {k: float((got[k].float() - ref[k].float()).abs().max()) for k in ref}
    print("mhc max errors", errs)
    for k in ("x", "out"):
        assert errs[k] <= GPU_TOL["bf16_rel"] * float(ref[k].float().abs().max()), k
    assert errs["post"] <= GPU_TOL["post"] and errs["comb"] <= GPU_TOL["comb"]
    for a, b in zip(ggot, gref):
        scale = float(b.float().abs().max())
        err = float((a.float() - b.float()).abs().max())
        print(f"grad max error {err:.3e} (scale {scale:.3e})")
        assert err <= GPU_TOL["grad"] * scale
