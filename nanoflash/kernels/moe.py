"""The routed experts at GEMM speed: token slots permuted on the device, grouped GEMMs over the stacked
weights, and a fused SwiGLU in Triton.

1. Slots (plain torch, used by both dispatchers and on every `kernels` path, the reference included): the N*K
   (token, k) slots sorted by expert (`sort_slots`, a stable sort, and its inverse by a scatter), per-expert
   counts on the device (`expert_counts`; `bincount` would read its max on the host), token rows gathered into
   slot order (`GatherSlots`) and the expert outputs summed back per token in fp32 (`combine_slots`). Both
   backwards are a gather and a sum over k in a fixed order: deterministic, no atomics.

2. `grouped_experts` computes exactly the `kernels="reference"` loop of `model.RoutedExperts` (one
   `expert_ffn` per expert) on the expert-sorted rows, group e's rows being [offs[e-1], offs[e]):

    h   = x W13_e^T                 [T,2I]   one grouped GEMM (torch._grouped_mm) for every expert's w1|w3
    a   = silu(min(g, L)) * clamp(u, -L, L) * rw    with g, u = h[:, :I], h[:, I:], in fp32 registers
    y   = a W2_e^T                  [T,D]    one grouped GEMM for w2

   The offsets are a cumulative sum of the counts on the GPU: nothing is read on the host. The SwiGLU kernel
   reads h once and writes a once; its backward re-reads h, so autograd keeps h and a (bf16) instead of the
   fp32 g, u, silu(g), silu(g) u of the eager version:

    da' = da * rw,   dg = da' u silu'(g) [g <= L],   du = da' silu(g) [|u| <= L],   drw = sum_i da silu(g) u

   drw is summed over the I columns inside one program per row block (registers, no atomics).
   Off CUDA or in fp32, `grouped_mm` falls back to a loop over the groups (same semantics, sizes on the host).

Shapes: x [T,D] expert-sorted, rw [T,1] fp32, counts [E_l], w13 [E_l,2I,D], w2 [E_l,D,I] -> [T,D]

Tests: `pytest tests/test_model_moe.py` (CPU, the Triton interpreter in a subprocess) and
`tests/test_model_moe_gpu.py` (H200). Speed: `bench/parallel_moe_gemm.py`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoflash.quant import ACT_QAT_BLOCK, fp8_sim, qat_block

# Block of the SwiGLU kernels: BLOCK_T rows x BLOCK_I columns per step (the backward loops over the columns
# of its row block). Memory-bound elementwise work: 4K elements per program keep the loads vectorised.
FWD_BLOCK = dict(BLOCK_T=16, BLOCK_I=256, num_warps=4)
BWD_BLOCK = dict(BLOCK_T=16, BLOCK_I=256, num_warps=4)
GROUPED_ALIGN = 8   # torch._grouped_mm wants 16-byte aligned rows: bf16 K and N multiples of 8


# ---------------------------------------------------------------------------------------------- slots
def sort_slots(indices: torch.Tensor):
    """The N*K (token, k) slots sorted by expert (stable) and the inverse permutation (inv[order[j]] = j, a
    scatter of distinct indices).  indices [N,K] -> order, inv [N*K]"""
    order = indices.flatten().argsort(stable=True)
    return order, torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def expert_counts(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Slots per expert, on the device (bincount would read its max on the host).  [N,K] -> [E] int64"""
    return indices.new_zeros(n_experts).scatter_add_(0, indices.flatten(), torch.ones_like(indices.flatten()))


class GatherSlots(torch.autograd.Function):
    """rows = x[order // K], each token in its K slots in expert order; the backward un-permutes and sums a
    token's K slot gradients in k order (a gather and a sum: deterministic, no atomics).

    Shapes: x [N,D], order / inv [N*K] -> [N*K,D]
    """

    @staticmethod
    def forward(ctx, x, order, inv, K):
        ctx.save_for_backward(inv)
        ctx.K = K
        return x.index_select(0, order // K)

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        return g.index_select(0, inv).unflatten(0, (-1, ctx.K)).sum(1), None, None, None         # [N,D]


def combine_slots(y: torch.Tensor, inv: torch.Tensor, K: int) -> torch.Tensor:
    """y_n = sum_k y[slot (n, k)] in fp32, k in order (deterministic).  y [N*K,D] expert-sorted -> [N,D] fp32"""
    return y.index_select(0, inv).unflatten(0, (-1, K)).sum(1, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- SwiGLU
@triton.jit
def _swiglu_fwd(h, rw, a, T, I, limit, HAS_LIMIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    """a[t, i] = silu(min(g, L)) * clamp(u, -L, L) * rw[t], g = h[t, i], u = h[t, I + i] (fp32 math)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    rmask = rows < T
    mask = rmask[:, None] & (cols[None, :] < I)
    hp = h + rows.to(tl.int64)[:, None] * (2 * I) + cols[None, :]
    g = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(hp + I, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(rw + rows, mask=rmask, other=0.0)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    out = g * tl.sigmoid(g) * u * w[:, None]
    tl.store(a + rows.to(tl.int64)[:, None] * I + cols[None, :], out.to(a.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(h, rw, da, dh, drw, T, I, limit, HAS_LIMIT: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_I: tl.constexpr):
    """dh = (dg, du) and drw for one block of rows, looping over the I columns (drw stays in registers)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    r = rows.to(tl.int64)[:, None]
    w = tl.load(rw + rows, mask=rmask, other=0.0)
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for c in range(0, I, BLOCK_I):
        cols = c + tl.arange(0, BLOCK_I)
        mask = rmask[:, None] & (cols[None, :] < I)
        g0 = tl.load(h + r * (2 * I) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u0 = tl.load(h + r * (2 * I) + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        d = tl.load(da + r * I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g, u = g0, u0
        if HAS_LIMIT:
            g = tl.minimum(g0, limit)
            u = tl.minimum(tl.maximum(u0, -limit), limit)
        s = tl.sigmoid(g)
        silu = g * s
        acc += tl.sum(d * (silu * u), 1)
        dp = d * w[:, None]
        dg = dp * u * (s * (1.0 + g * (1.0 - s)))
        du = dp * silu
        if HAS_LIMIT:   # clamp passes the gradient where the input was inside (bounds included), as torch
            dg = tl.where(g0 <= limit, dg, 0.0)
            du = tl.where((u0 >= -limit) & (u0 <= limit), du, 0.0)
        tl.store(dh + r * (2 * I) + cols[None, :], dg.to(dh.dtype.element_ty), mask=mask)
        tl.store(dh + r * (2 * I) + I + cols[None, :], du.to(dh.dtype.element_ty), mask=mask)
    tl.store(drw + rows, acc, mask=rmask)


class _SwiGLU(torch.autograd.Function):
    """Fused `model.swiglu(g, u, L, rw)` on h = [g | u] (see the module docstring).

    Shapes: h [T,2I], rw [T,1] fp32 -> a [T,I] in h's dtype
    """

    @staticmethod
    def forward(ctx, h, rw, limit):
        T, I = h.shape[0], h.shape[1] // 2
        h, w = h.contiguous(), rw.reshape(-1).float().contiguous()                   # [T,2I], [T]
        a = torch.empty(T, I, dtype=h.dtype, device=h.device)
        cfg = FWD_BLOCK
        grid = (triton.cdiv(T, cfg["BLOCK_T"]), triton.cdiv(I, cfg["BLOCK_I"]))
        _swiglu_fwd[grid](h, w, a, T, I, float(limit), HAS_LIMIT=limit > 0, **cfg)
        ctx.save_for_backward(h, w)
        ctx.limit, ctx.rw_shape, ctx.rw_dtype = limit, rw.shape, rw.dtype
        return a

    @staticmethod
    def backward(ctx, da):
        h, w = ctx.saved_tensors
        T, I = h.shape[0], h.shape[1] // 2
        dh, drw = torch.empty_like(h), torch.empty_like(w)
        cfg = BWD_BLOCK
        _swiglu_bwd[(triton.cdiv(T, cfg["BLOCK_T"]),)](h, w, da.contiguous(), dh, drw, T, I, float(ctx.limit),
                                                        HAS_LIMIT=ctx.limit > 0, **cfg)
        return dh, drw.view(ctx.rw_shape).to(ctx.rw_dtype), None


def fused_swiglu(h: torch.Tensor, rw: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, L)) * clamp(u, -L, L) * rw over h = [g | u], fp32 math, one read and one write.
    h [T,2I], rw [T,1] fp32 -> [T,I] (h's dtype)"""
    if h.dim() != 2 or h.shape[1] % 2 or rw.numel() != h.shape[0]:
        raise ValueError(f"fused_swiglu: h must be [T, 2I] and rw [T, 1], got {tuple(h.shape)}, {tuple(rw.shape)}")
    return _SwiGLU.apply(h, rw, float(limit))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """y[rows of e] = x[rows of e] w[e]^T with consecutive groups (offs = cumulative row ends, on the device).
    CUDA bf16 with aligned dims: one `torch._grouped_mm`. Elsewhere a loop over the groups, sizes on the host.
    x [T,K], w [E,N,K], offs / counts [E] -> [T,N]"""
    if x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and x.shape[1] % GROUPED_ALIGN == 0 \
            and w.shape[1] % GROUPED_ALIGN == 0:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    return torch.cat([F.linear(xe, we) for xe, we in zip(x.split(counts.tolist()), w.unbind(0))])


def grouped_experts(x, rw, counts, w13, w2, limit: float, qat: bool = False, act=None) -> torch.Tensor:
    """The routed experts on expert-sorted rows: grouped w13 GEMM -> fused SwiGLU (x rw) -> grouped w2 GEMM.
    `qat` FP8-simulates both GEMM inputs per 1x128 block, as the reference. `act` is the model's SwiGLU
    (`model.swiglu`), used where the reference rounds between GEMM and activation (x's dtype differs from the
    weights'): the kernels take the model's math as an argument, never import it.
    x [T,D], rw [T,1] fp32, counts [E_l], w13 [E_l,2I,D], w2 [E_l,D,I] -> [T,D]"""
    if x.shape[0] == 0:   # an EP rank that received no rows (x[:0] keeps the exchange's backward)
        return x[:0]
    offs = counts.cumsum(0).to(torch.int32)                                             # [E_l] row ends
    h = x.to(w13.dtype)
    h = fp8_sim(h, qat_block(h.shape[-1], ACT_QAT_BLOCK)) if qat else h
    h = grouped_mm(h, w13, offs, counts)                                                # [T,2I]
    if x.dtype == h.dtype:
        a = fused_swiglu(h, rw, limit).to(w2.dtype)                                     # [T,I]
    else:   # the reference rounds a to x's dtype first
        if act is None:
            raise ValueError(f"grouped_experts: x is {x.dtype}, the weights {w13.dtype}: pass act=model.swiglu")
        a = act(*h.chunk(2, -1), limit, rw).to(x.dtype).to(w2.dtype)
    a = fp8_sim(a, qat_block(a.shape[-1], ACT_QAT_BLOCK)) if qat else a
    return grouped_mm(a, w2, offs, counts)                                              # [T,D]
