"""bf16 GEMMs with an fp32 result, for the matmuls the official model runs in fp32 (head, gate, compressor).

The official code upcasts x and the weight and multiplies in fp32 (`F.linear(x.float(), w.float())`): on an
H200 that is the CUDA-core fp32 path (~50 TFLOP/s, TF32 off), against ~700 TFLOP/s for bf16 tensor cores.
When x and w are bf16-representable (x comes out of an RMSNorm cast to bf16; the checkpoint stores these
weights in bf16), a bf16 GEMM with fp32 accumulation and an fp32 output gives the same products exactly and
differs from the fp32 path only in summation order: `torch.mm(a, b, out_dtype=torch.float32)` (CUDA).
An fp32 master weight is rounded to bf16 here (once per call; `linear_fp32(x, w, wb=)` takes a cached copy).

Backward: the incoming fp32 gradient is rounded to bf16 (2^-9 relative per element) for the two tensor-core
GEMMs; dx comes out in x's dtype, dw in fp32 (accumulated in fp32, returned in w's dtype).

Dispatch: `ModelConfig.kernels == "triton"` on CUDA (model.fp32_linear); "reference" (matched precision) and
"auto" keep the fp32 path. Tests: tests/test_kernels_matmul.py (CPU: the fallback math and the switch;
GPU-marked: against the fp32 path at real width).
"""
from __future__ import annotations

import torch


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [m,k] bf16 @ b [k,n] bf16 -> [m,n] fp32, fp32 accumulation (CUDA), exact fp32 math elsewhere."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class Bf16LinearFp32(torch.autograd.Function):
    """y = x W^T in fp32 from bf16 operands.  x [..., K], w [N, K] (any float dtype), wb = w in bf16 -> [..., N] fp32"""

    @staticmethod
    def forward(ctx, x, w, wb):
        xb = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)                                # [n,K]
        ctx.save_for_backward(xb, wb)
        ctx.meta = (x.shape, x.dtype, w.dtype)
        return _mm32(xb, wb.t()).view(*x.shape[:-1], wb.shape[0])

    @staticmethod
    def backward(ctx, g):
        xb, wb = ctx.saved_tensors
        shape, xdt, wdt = ctx.meta
        gb = g.reshape(-1, g.shape[-1]).to(torch.bfloat16)                                # [n,N]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (gb @ wb).view(shape).to(xdt) if gb.is_cuda else (gb.float() @ wb.float()).view(shape).to(xdt)
        if ctx.needs_input_grad[1]:
            dw = _mm32(gb.t().contiguous(), xb).to(wdt)
        return dx, dw, None


def linear_fp32(x: torch.Tensor, w: torch.Tensor, wb: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T -> fp32 through bf16 tensor cores; `wb` a bf16 copy of w (made here if None). [..., K] -> [..., N]"""
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"linear_fp32: x has {x.shape[-1]} features, weight {tuple(w.shape)} expects {w.shape[-1]}")
    wb = w.detach().to(torch.bfloat16) if wb is None else wb
    return Bf16LinearFp32.apply(x, w, wb)


class ChunkLogprobBf16(torch.autograd.Function):
    """`model._ChunkLogprob` with its GEMMs on bf16 tensor cores (fp32 logits, recomputed in backward).
    y [n,D], w [V,D], wb = w in bf16, tgt [n] -> log softmax(y W^T / T)[tgt] [n] fp32"""

    @staticmethod
    def forward(ctx, y, w, wb, tgt, temperature):
        yb = y.to(torch.bfloat16)
        logits = _mm32(yb, wb.t()) / temperature                                          # [n,V]
        lse = logits.logsumexp(-1)
        ctx.save_for_backward(yb, wb, tgt, lse)
        ctx.meta = (temperature, y.dtype, w.dtype)
        return logits.gather(-1, tgt[:, None])[:, 0] - lse

    @staticmethod
    def backward(ctx, g):
        yb, wb, tgt, lse = ctx.saved_tensors
        temperature, ydt, wdt = ctx.meta
        logits = _mm32(yb, wb.t()) / temperature
        dlogits = -(logits - lse[:, None]).exp()                                          # -softmax
        dlogits.scatter_add_(-1, tgt[:, None], torch.ones_like(lse)[:, None])
        gb = (dlogits * (g[:, None] / temperature)).to(torch.bfloat16)                   # [n,V]
        dy = (gb @ wb) if gb.is_cuda else gb.float() @ wb.float()
        return dy.to(ydt), _mm32(gb.t().contiguous(), yb).to(wdt), None, None, None
