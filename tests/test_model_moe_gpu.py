"""The grouped MoE path on a GPU (H200): torch._grouped_mm + the compiled Triton SwiGLU against the
per-expert reference loop evaluated in float64, no host synchronisation at EP = 1, and bitwise-deterministic
forward and backward. Not run in CI (`-m gpu`): `pytest -m gpu tests/test_model_moe_gpu.py`.
"""
import dataclasses

import pytest
import torch

from nanoflash.checkpoint_names import official_views
from nanoflash.config import preset
from nanoflash.model import MoE

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# bf16 grouped path vs the float64 reference: h, a and y are rounded to bf16 (2^-9 relative each) and the
# gradients sum ~N*K/E bf16 products per weight; relative to the largest value, measured <= 6e-3, so 2^-5.
BF16_TOL = 2 ** -5
# ... and no worse than the bf16 reference loop itself by more than this factor (same roundings, other order)
WORSE_THAN_LOOP = 2.0
FP32_TOL = 1e-5   # fp32 on CUDA: the grouped_mm fallback loop + the Triton SwiGLU (TF32 off)
SHAPES = dict(dim=512, moe_inter_dim=256, n_routed_experts=16, n_activated_experts=6, n_hash_layers=0)
N_TOK = 2048


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _module(kernels: str, dtype, seed=0):
    cfg = preset("tiny", kernels=kernels, **SHAPES)
    g = torch.Generator().manual_seed(seed)
    m = MoE(3, cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        m.gate.bias.copy_(torch.linspace(2.0, -6.0, cfg.n_routed_experts))   # skewed: the last experts empty
    return m.to("cuda", dtype)


def _data(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, N_TOK, SHAPES["dim"], generator=g)
    return x.to("cuda", dtype), torch.zeros(1, N_TOK, dtype=torch.long, device="cuda"), \
        torch.randn(1, N_TOK, SHAPES["dim"], generator=g).cuda()


def _run(m, x, ids, cot):
    m.zero_grad()
    x = x.detach().clone().requires_grad_()
    y = m(x, ids)
    (y.double() * cot.double()).sum().backward()
    grads = {n: t for name, p in m.named_parameters()
             for n, t in official_views(name, p, torch.zeros_like(p) if p.grad is None else p.grad)}
    return y.detach(), x.grad, grads


def _errors(got, want):
    (y, dx, g), (ry, rdx, rg) = got, want
    errs = {"y": rel_err(y, ry), "dx": rel_err(dx, rdx)}
    for n in rg:
        if rg[n].abs().max() > 0:
            errs[n] = rel_err(g[n], rg[n])
        else:
            assert g[n].abs().max() == 0, f"{n}: gradient where the reference has none"
    return errs


def test_grouped_bf16_matches_float64_reference():
    ref = _module("reference", torch.float64)
    x, ids, cot = _data(torch.float64)
    want = _run(ref, x, ids, cot)
    counts = torch.bincount(ref.last_indices.flatten(), minlength=16)
    assert (counts == 0).any() and counts.max() > 2 * counts.float().mean(), counts   # empty and crowded experts
    fast, loop = _module("triton", torch.bfloat16), _module("reference", torch.bfloat16)
    xb = x.to(torch.bfloat16)
    e_fast, e_loop = _errors(_run(fast, xb, ids, cot), want), _errors(_run(loop, xb, ids, cot), want)
    for n, e in e_fast.items():
        assert e <= BF16_TOL and e <= WORSE_THAN_LOOP * e_loop[n] + 2 ** -9, f"{n}: {e:.2e} (loop {e_loop[n]:.2e})"


def test_grouped_fp32_on_cuda_matches_reference():
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, fast = _module("reference", torch.float32), _module("triton", torch.float32)
    x, ids, cot = _data(torch.float32)
    for n, e in _errors(_run(fast, x, ids, cot), _run(ref, x, ids, cot)).items():
        assert e <= FP32_TOL, f"{n}: {e:.2e}"


def test_no_host_sync_and_deterministic_at_ep1():
    """Forward + backward with the CUDA sync debug mode set to "error": any host read would raise. Two runs
    give bitwise equal outputs and gradients (no atomics anywhere on the path)."""
    m = _module("triton", torch.bfloat16)
    x, ids, cot = _data(torch.bfloat16)
    first = _run(m, x, ids, cot)          # warm-up: Triton compiles, cuBLAS handles are created
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = _run(m, x, ids, cot)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert all(torch.equal(first[2][n], second[2][n]) for n in first[2])
