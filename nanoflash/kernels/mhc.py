"""Fused mHC in Triton: `hc_pre` (mixes -> Sinkhorn -> collapse) and `hc_post`, forward and backward.

Why the compiled version sat at 0.058 of copy bandwidth (docs/benchmarks.md B14a): the mixes are a skinny
fp32 GEMM h[T, M*D] . fn^T[M*D, 24] that needs h upcast to an fp32 copy ([T,16384] fp32: 2x the bytes of h,
written and read again) and runs on cuBLAS's fp32 path with N = 24; the backward repeats it twice
(dh = g . fn and dfn = g^T . h, the second also over an fp32 copy), and the Sinkhorn graph of [T,4,4]
tensors and its 39-step backward are several dozen small kernels. Here every pass reads h in its own dtype,
upcasts in registers, and touches it once:

    forward   _mix_fwd      h -> mixes [T,24] = (h . fn^T) * rsqrt(mean h^2 + eps), rs [T]   (1 read of h)
              _sinkhorn_fwd mixes -> pre, post [T,M], comb [T,M,M]: softmax + eps, column, 19 x (row, column),
                            per token in registers (20 iterations, the official eps)
              _collapse     x[t] = sum_j pre[t,j] h[t,j]                                      (1 read of h)
              _post_fwd     out[t,k] = post[t,k] x[t] + sum_j comb[t,j,k] res[t,j]            (read res, write)
    backward  _post_bwd     dx, dres, dpost = sum_d dout x, dcomb = sum_d res dout           (one pass)
              _pre_coeff    dpre = sum_d dx h_j, then the Sinkhorn backward per token by recomputing the
                            forward iterations (no saved intermediates), -> d(logits) [T,24]
              _pre_dh       dh = (g rs) . fn - c h + pre_j dx,  c = (g . mixes) rs^2 / (M D)    (one pass)
              _pre_dfn      dfn = (g rs)^T . h, split over tokens, partial sums added by torch

The arithmetic is the reference's (`model.hc_pre_reference`, `model.hc_post`) in fp32, and the hc_pre gradient
of h is summed in fp32 once instead of twice rounded to bf16. The three M*D-long dots: fp32 streams use FMA
dots (input_precision="ieee": summation order only); bf16 streams use tensor cores -- the mixes and dfn as
bf16 h times an fp32 operand split into three bf16 parts (`split3`: exact products), dh in tf32x3 (bf16x6 on
AMD, which has no tf32x3: `target.py`) -- which is 4x faster for the mixes but accumulates less exactly
(post / comb 5.6e-5 from the reference vs 5.4e-6 on the FMA path at real width; tests/test_kernels_mhc.py).
Under TRITON_INTERPRET=1 the same kernels run on CPU.

H200, h [1, 8192, 4, 4096] bf16 (bench/bench_mhc.py, docs/benchmarks.md B14b): fwd+bwd 2.42 ms (eager 13.71,
compiled 9.00), 0.21 of copy bandwidth at the 8 x |h| byte floor. Per call: _pre_coeff 407 us, _pre_dh 391,
_post_bwd 375, _mix_fwd 330, _post_fwd 166, _pre_dfn 108, _collapse 81, _sinkhorn_fwd 10 (+ 364 us of torch
adds: the two gradients of h summed by autograd).

Dispatch: `ModelConfig.kernels`; "triton" on CUDA uses `hc_pre_fused` / `hc_post_fused` in `Block.forward`
(run inside the 8-layer real-geometry stack on the H200, bench/bench_stack.py); "auto" only in forwards with a
decode cache (`model.decode_kernels`: the rollout engine, where the reference's Sinkhorn is ~40% of a step's
launches), not yet in training.
Tests: tests/test_kernels_mhc.py.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from nanoflash.kernels import target as tgt

BT_MIX, BK_MIX = 32, 128   # token rows x K chunk of the mixes GEMM (tl.dot needs >= 16 on each side; fn
                           # [24,K] is re-read from L2 once per 32 tokens)
BT_TOK, BD = 16, 64        # token rows x D chunk of the streaming kernels
BT_DH = 32                 # token rows of the dh pass (its fn tile is re-read per token block)
BT_COEF = 16               # tokens per program of the per-token Sinkhorn kernels
BK_DFN = 128               # K columns per program of the dfn reduction
DFN_MIN_TOKENS = 512       # tokens per split of the dfn reduction at least (up to 16 splits; tests lower it)


# ------------------------------------------------------------------------------------------ forward kernels
@triton.jit
def _mix_fwd(h_ptr, fn_ptr, mix_ptr, rs_ptr, T, K, norm_eps,
             NMIX: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.arange(0, NP)
    tm, cm = t < T, c < NMIX
    acc = tl.zeros([BT, NP], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        hv = tl.load(h_ptr + t[:, None].to(tl.int64) * K + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        fo = c[None, :] * K + k[:, None]
        fm = cm[None, :] & km[:, None]
        if SPLIT:   # bf16 h times fn = hi + mid + lo (three bf16 parts): exact products, fp32 sums
            for part in tl.static_range(3):
                acc += tl.dot(hv, tl.load(fn_ptr + part * NMIX * K + fo, mask=fm, other=0.0))
        else:
            acc += tl.dot(hv.to(tl.float32), tl.load(fn_ptr + fo, mask=fm, other=0.0), input_precision="ieee")
        hv = hv.to(tl.float32)                                                          # [BT,BK]
        ss += tl.sum(hv * hv, 1)
    rs = 1.0 / tl.sqrt(ss / K + norm_eps)
    tl.store(mix_ptr + t[:, None] * NMIX + c[None, :], acc * rs[:, None], mask=tm[:, None] & cm[None, :])
    tl.store(rs_ptr + t, rs, mask=tm)


@triton.jit
def _comb_logits(mix_ptr, scale_ptr, base_ptr, t, tm, NMIX: tl.constexpr, M: tl.constexpr):
    """The comb logits of tokens t as [BT, M(j), M(k)] (row-major j*M+k after the 2M pre/post entries)."""
    j = tl.arange(0, M)
    off = 2 * M + j[:, None] * M + j[None, :]                                           # [M,M]
    m = tl.load(mix_ptr + t[:, None, None] * NMIX + off[None], mask=tm[:, None, None], other=0.0)
    return m, m * tl.load(scale_ptr + 2) + tl.load(base_ptr + off)[None]


@triton.jit
def _softmax_k(z):
    p = tl.exp(z - tl.max(z, 2)[:, :, None])
    return p / tl.sum(p, 2)[:, :, None]


@triton.jit
def _sinkhorn_fwd(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, eps,
                  ITERS: tl.constexpr, NMIX: tl.constexpr, M: tl.constexpr, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < T
    j = tl.arange(0, M)
    m_pre = tl.load(mix_ptr + t[:, None] * NMIX + j[None, :], mask=tm[:, None], other=0.0)      # [BT,M]
    m_post = tl.load(mix_ptr + t[:, None] * NMIX + M + j[None, :], mask=tm[:, None], other=0.0)
    pre = tl.sigmoid(m_pre * tl.load(scale_ptr) + tl.load(base_ptr + j)[None, :]) + eps
    post = 2 * tl.sigmoid(m_post * tl.load(scale_ptr + 1) + tl.load(base_ptr + M + j)[None, :])
    tl.store(pre_ptr + t[:, None] * M + j[None, :], pre, mask=tm[:, None])
    tl.store(post_ptr + t[:, None] * M + j[None, :], post, mask=tm[:, None])
    _, z = _comb_logits(mix_ptr, scale_ptr, base_ptr, t, tm, NMIX, M)
    c = _softmax_k(z) + eps
    c = c / (tl.sum(c, 1)[:, None, :] + eps)                                            # columns (sum over j)
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, 2)[:, :, None] + eps)                                        # rows (sum over k)
        c = c / (tl.sum(c, 1)[:, None, :] + eps)
    off = t[:, None, None] * (M * M) + j[None, :, None] * M + j[None, None, :]
    tl.store(comb_ptr + off, c, mask=tm[:, None, None])


@triton.jit
def _collapse(h_ptr, pre_ptr, x_ptr, T, D, M: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    j = tl.arange(0, M)
    tm, dm = t < T, d < D
    row = (t[:, None, None].to(tl.int64) * M + j[None, :, None]) * D + d[None, None, :]
    hv = tl.load(h_ptr + row, mask=tm[:, None, None] & dm[None, None, :], other=0.0).to(tl.float32)  # [BT,M,BD]
    pre = tl.load(pre_ptr + t[:, None] * M + j[None, :], mask=tm[:, None], other=0.0)             # [BT,M]
    x = tl.sum(hv * pre[:, :, None], 1)
    tl.store(x_ptr + t[:, None].to(tl.int64) * D + d[None, :], x.to(x_ptr.dtype.element_ty),
             mask=tm[:, None] & dm[None, :])


@triton.jit
def _post_fwd(x_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, T, D, M: tl.constexpr, BT: tl.constexpr,
              BD: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    j = tl.arange(0, M)
    tm, dm = t < T, d < D
    m2 = tm[:, None] & dm[None, :]
    t64 = t.to(tl.int64)
    xv = tl.load(x_ptr + t64[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)       # [BT,BD]
    row = (t64[:, None, None] * M + j[None, :, None]) * D + d[None, None, :]
    rv = tl.load(res_ptr + row, mask=m2[:, None, :], other=0.0).to(tl.float32)                 # [BT,M,BD]
    for k in tl.static_range(M):
        ck = tl.load(comb_ptr + t[:, None] * (M * M) + j[None, :] * M + k, mask=tm[:, None], other=0.0)  # [BT,M]
        pk = tl.load(post_ptr + t * M + k, mask=tm, other=0.0)
        o = pk[:, None] * xv + tl.sum(ck[:, :, None] * rv, 1)
        tl.store(out_ptr + (t64[:, None] * M + k) * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=m2)


# ------------------------------------------------------------------------------------------ backward kernels
@triton.jit
def _post_bwd(g_ptr, x_ptr, res_ptr, post_ptr, comb_ptr, dx_ptr, dres_ptr, dpost_ptr, dcomb_ptr, T, D,
              M: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    j = tl.arange(0, M)
    tm = t < T
    t64 = t.to(tl.int64)
    post = tl.load(post_ptr + t[:, None] * M + j[None, :], mask=tm[:, None], other=0.0)          # [BT,M(k)]
    dpost = tl.zeros([BT, M], tl.float32)
    dcomb = tl.zeros([BT, M, M], tl.float32)                                                   # [BT,j,k]
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m2 = tm[:, None] & (d < D)[None, :]
        row = (t64[:, None, None] * M + j[None, :, None]) * D + d[None, None, :]
        g = tl.load(g_ptr + row, mask=m2[:, None, :], other=0.0).to(tl.float32)               # [BT,M(k),BD]
        xv = tl.load(x_ptr + t64[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        tl.store(dx_ptr + t64[:, None] * D + d[None, :], tl.sum(post[:, :, None] * g, 1).to(dx_ptr.dtype.element_ty),
                 mask=m2)
        dpost += tl.sum(xv[:, None, :] * g, 2)
        for jj in tl.static_range(M):
            cj = tl.load(comb_ptr + t[:, None] * (M * M) + jj * M + j[None, :], mask=tm[:, None], other=0.0)  # [BT,k]
            rj = tl.load(res_ptr + (t64[:, None] * M + jj) * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            tl.store(dres_ptr + (t64[:, None] * M + jj) * D + d[None, :],
                     tl.sum(cj[:, :, None] * g, 1).to(dres_ptr.dtype.element_ty), mask=m2)
            dcomb += tl.where(j[None, :, None] == jj, tl.sum(rj[:, None, :] * g, 2)[:, None, :], 0.0)
    tl.store(dpost_ptr + t[:, None] * M + j[None, :], dpost, mask=tm[:, None])
    off = t[:, None, None] * (M * M) + j[None, :, None] * M + j[None, None, :]
    tl.store(dcomb_ptr + off, dcomb, mask=tm[:, None, None])


@triton.jit
def _norm_step(x, i, eps):
    """Step i of the Sinkhorn forward on x [BT,M,M]: even i normalises columns (sum over j), odd i rows."""
    col = x / (tl.sum(x, 1)[:, None, :] + eps)
    row = x / (tl.sum(x, 2)[:, :, None] + eps)
    return tl.where(i % 2 == 0, col, row)


@triton.jit
def _pre_coeff(dx_ptr, h_ptr, dpost_ptr, dcomb_ptr, mix_ptr, scale_ptr, base_ptr, dlog_ptr, T, D, eps,
               ITERS: tl.constexpr, NMIX: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    j = tl.arange(0, M)
    tm = t < T
    t64 = t.to(tl.int64)
    dpre = tl.zeros([BT, M], tl.float32)
    for d0 in range(0, D, BD):                                         # dpre[t,j] = sum_d dx[t,d] h[t,j,d]
        d = d0 + tl.arange(0, BD)
        m2 = tm[:, None] & (d < D)[None, :]
        dxv = tl.load(dx_ptr + t64[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        row = (t64[:, None, None] * M + j[None, :, None]) * D + d[None, None, :]
        hv = tl.load(h_ptr + row, mask=m2[:, None, :], other=0.0).to(tl.float32)
        dpre += tl.sum(hv * dxv[:, None, :], 2)
    mrow = t[:, None] * NMIX + j[None, :]
    sp = tl.sigmoid(tl.load(mix_ptr + mrow, mask=tm[:, None], other=0.0) * tl.load(scale_ptr)
                    + tl.load(base_ptr + j)[None, :])
    so = tl.sigmoid(tl.load(mix_ptr + mrow + M, mask=tm[:, None], other=0.0) * tl.load(scale_ptr + 1)
                    + tl.load(base_ptr + M + j)[None, :])
    dpost = tl.load(dpost_ptr + t[:, None] * M + j[None, :], mask=tm[:, None], other=0.0)
    tl.store(dlog_ptr + mrow, dpre * sp * (1 - sp), mask=tm[:, None])
    tl.store(dlog_ptr + mrow + M, dpost * 2 * so * (1 - so), mask=tm[:, None])
    _, z = _comb_logits(mix_ptr, scale_ptr, base_ptr, t, tm, NMIX, M)
    p = _softmax_k(z)
    off = t[:, None, None] * (M * M) + j[None, :, None] * M + j[None, None, :]
    dy = tl.load(dcomb_ptr + off, mask=tm[:, None, None], other=0.0)
    NSTEP: tl.constexpr = 2 * ITERS - 1
    for r in range(NSTEP):                 # steps NSTEP-1 .. 0: recompute step i's input, then y = x / (s + eps)
        i = NSTEP - 1 - r
        x = p + eps
        for q in range(i):
            x = _norm_step(x, q, eps)
        sc = tl.sum(x, 1)[:, None, :] + eps
        sr = tl.sum(x, 2)[:, :, None] + eps
        dcol = (dy - tl.sum(dy * (x / sc), 1)[:, None, :]) / sc    # dx = (dy - sum(dy * y)) / (s + eps)
        drow = (dy - tl.sum(dy * (x / sr), 2)[:, :, None]) / sr
        dy = tl.where(i % 2 == 0, dcol, drow)
    dz = p * (dy - tl.sum(dy * p, 2)[:, :, None])                    # softmax backward over k
    tl.store(dlog_ptr + t[:, None, None] * NMIX + 2 * M + j[None, :, None] * M + j[None, None, :], dz,
             mask=tm[:, None, None])


@triton.jit
def _pre_dh(dx_ptr, h_ptr, fn_ptr, grs_ptr, ct_ptr, pre_ptr, dh_ptr, T, D,
            NMIX: tl.constexpr, NP: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
            PREC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    c = tl.arange(0, NP)
    tm, dm, cm = t < T, d < D, c < NMIX
    m2 = tm[:, None] & dm[None, :]
    t64 = t.to(tl.int64)
    dxv = tl.load(dx_ptr + t64[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)     # [BT,BD]
    grs = tl.load(grs_ptr + t[:, None] * NMIX + c[None, :], mask=tm[:, None] & cm[None, :], other=0.0)  # [BT,NP]
    ct = tl.load(ct_ptr + t, mask=tm, other=0.0)
    for jj in tl.static_range(M):
        hj = tl.load(h_ptr + (t64[:, None] * M + jj) * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        fj = tl.load(fn_ptr + c[:, None] * (M * D) + jj * D + d[None, :], mask=cm[:, None] & dm[None, :],
                     other=0.0)                                                                  # [NP,BD]
        pj = tl.load(pre_ptr + t * M + jj, mask=tm, other=0.0)
        dh = tl.dot(grs, fj, input_precision=PREC) - ct[:, None] * hj + pj[:, None] * dxv
        tl.store(dh_ptr + (t64[:, None] * M + jj) * D + d[None, :], dh.to(dh_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _pre_dfn(grs_ptr, h_ptr, part_ptr, T, K, t_per_split,
             NMIX: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    split = tl.program_id(1)
    c = tl.arange(0, NP)
    km, cm = k < K, c < NMIX
    acc = tl.zeros([NP, BK], tl.float32)
    lo = split * t_per_split
    for t0 in range(lo, lo + t_per_split, BT):
        t = t0 + tl.arange(0, BT)
        tm = t < T
        go = t[None, :] * NMIX + c[:, None]                                                # [NP,BT]
        gm = cm[:, None] & tm[None, :]
        hv = tl.load(h_ptr + t[:, None].to(tl.int64) * K + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        if SPLIT:   # grs = hi + mid + lo in bf16 against bf16 h
            for part in tl.static_range(3):
                acc += tl.dot(tl.load(grs_ptr + part * T * NMIX + go, mask=gm, other=0.0), hv)
        else:
            acc += tl.dot(tl.load(grs_ptr + go, mask=gm, other=0.0), hv.to(tl.float32), input_precision="ieee")
    tl.store(part_ptr + (split * NMIX + c[:, None]) * K + k[None, :], acc, mask=cm[:, None] & km[None, :])


# ------------------------------------------------------------------------------------------ autograd
def split3(a: torch.Tensor) -> torch.Tensor:
    """fp32 a -> [3, *a.shape] bf16 with hi + mid + lo = a to ~2^-24 relative (each part rounds the rest)."""
    hi = a.to(torch.bfloat16)
    mid = (a - hi.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, (a - hi.float() - mid.float()).to(torch.bfloat16)]).contiguous()


def _check(h, M):
    if h.dim() != 4 or h.shape[2] != M or M & (M - 1):
        raise ValueError(f"fused mHC needs h [B,S,M,D] with M = hc_mult a power of two; got {tuple(h.shape)}, M={M}")


class HcPre(torch.autograd.Function):
    """h [B,S,M,D] -> (x [B,S,D] in h's dtype, post [B,S,M] fp32, comb [B,S,M,M] fp32), = model.hc_pre_reference."""

    @staticmethod
    def forward(ctx, h, fn, scale, base, M, iters, eps, norm_eps):
        _check(h, M)
        B, S, _, D = h.shape
        T, K, NMIX = B * S, M * D, (2 + M) * M
        hc, fnc = h.contiguous(), fn.float().contiguous()
        sc, bc = scale.float().contiguous(), base.float().contiguous()
        f32 = dict(device=h.device, dtype=torch.float32)
        mix, rs = torch.empty(T, NMIX, **f32), torch.empty(T, **f32)
        NP = triton.next_power_of_2(NMIX)
        split = h.dtype == torch.bfloat16   # bf16 h: three exact bf16 MMAs instead of an fp32 FMA dot
        _mix_fwd[(triton.cdiv(T, BT_MIX),)](hc, split3(fnc) if split else fnc, mix, rs, T, K, norm_eps, NMIX, NP,
                                            BT_MIX, BK_MIX, split)
        pre, post, comb = torch.empty(T, M, **f32), torch.empty(T, M, **f32), torch.empty(T, M, M, **f32)
        _sinkhorn_fwd[(triton.cdiv(T, BT_COEF),)](mix, sc, bc, pre, post, comb, T, eps, iters, NMIX, M, BT_COEF)
        x = torch.empty(T, D, device=h.device, dtype=h.dtype)
        _collapse[(triton.cdiv(T, BT_TOK), triton.cdiv(D, BD))](hc, pre, x, T, D, M, BT_TOK, BD)
        ctx.save_for_backward(hc, fnc, sc, bc, mix, rs, pre)
        ctx.cfg = (M, iters, eps, fn.dtype, scale.dtype, base.dtype)
        return x.view(B, S, D), post.view(B, S, M), comb.view(B, S, M, M)

    @staticmethod
    def backward(ctx, dx, dpost, dcomb):
        hc, fn, sc, bc, mix, rs, pre = ctx.saved_tensors
        M, iters, eps, fdt, sdt, bdt = ctx.cfg
        B, S, _, D = hc.shape
        T, K, NMIX = B * S, M * D, (2 + M) * M
        NP = triton.next_power_of_2(NMIX)
        dx = torch.zeros(B, S, D, device=hc.device, dtype=hc.dtype) if dx is None else dx.contiguous()
        dpost = torch.zeros(T, M, device=hc.device) if dpost is None else dpost.float().contiguous()
        dcomb = torch.zeros(T, M, M, device=hc.device) if dcomb is None else dcomb.float().contiguous()
        dlog = torch.empty(T, NMIX, device=hc.device)
        _pre_coeff[(triton.cdiv(T, BT_COEF),)](dx, hc, dpost, dcomb, mix, sc, bc, dlog, T, D, eps, iters, NMIX, M,
                                               BT_COEF, BD)
        svec = torch.cat([sc[:2].repeat_interleave(M), sc[2:].expand(M * M)])            # [NMIX]
        g = dlog * svec                                                                  # d mixes [T,NMIX]
        grs = (g * rs[:, None]).contiguous()
        ct = ((g * mix).sum(-1) * rs.square() / K).contiguous()                          # [T]
        dh = torch.empty_like(hc)
        # bf16 streams: fp32 operands on the tensor cores (tf32x3 CUDA, bf16x6 AMD); fp32 streams: FMA dot
        target = tgt.device_target(hc.device)
        prec = tgt.split_fp32_precision(target) if target is not None and hc.dtype == torch.bfloat16 else "ieee"
        _pre_dh[(triton.cdiv(T, BT_DH), triton.cdiv(D, BD))](dx, hc, fn, grs, ct, pre, dh, T, D, NMIX, NP, M, BT_DH,
                                                              BD, prec)
        splits = max(1, min(16, T // DFN_MIN_TOKENS))
        per = triton.cdiv(triton.cdiv(T, splits), BT_MIX) * BT_MIX
        part = torch.empty(splits, NMIX, K, device=hc.device)
        split = hc.dtype == torch.bfloat16
        _pre_dfn[(triton.cdiv(K, BK_DFN), splits)](split3(grs) if split else grs, hc, part, T, K, per, NMIX, NP,
                                                   BT_MIX, BK_DFN, split)
        dscale = torch.stack([(dlog[:, :M] * mix[:, :M]).sum(), (dlog[:, M:2 * M] * mix[:, M:2 * M]).sum(),
                              (dlog[:, 2 * M:] * mix[:, 2 * M:]).sum()])
        return dh, part.sum(0).to(fdt), dscale.to(sdt), dlog.sum(0).to(bdt), None, None, None, None


class HcPost(torch.autograd.Function):
    """out_k = post_k x + sum_j comb[j,k] res_j (= model.hc_post).  x [B,S,D], res [B,S,M,D] -> [B,S,M,D]"""

    @staticmethod
    def forward(ctx, x, res, post, comb):
        B, S, M, D = res.shape
        _check(res, M)
        T = B * S
        xc, rc = x.contiguous(), res.contiguous()
        pc, cc = post.float().contiguous(), comb.float().contiguous()
        out = torch.empty(B, S, M, D, device=x.device, dtype=x.dtype)
        _post_fwd[(triton.cdiv(T, BT_TOK), triton.cdiv(D, BD))](xc, rc, pc, cc, out, T, D, M, BT_TOK, BD)
        ctx.save_for_backward(xc, rc, pc, cc)
        ctx.dtypes = (post.dtype, comb.dtype)
        return out

    @staticmethod
    def backward(ctx, g):
        xc, rc, pc, cc = ctx.saved_tensors
        B, S, M, D = rc.shape
        T = B * S
        dx, dres = torch.empty_like(xc), torch.empty_like(rc)
        dpost, dcomb = torch.empty(B, S, M, device=xc.device), torch.empty(B, S, M, M, device=xc.device)
        _post_bwd[(triton.cdiv(T, BT_TOK),)](g.contiguous(), xc, rc, pc, cc, dx, dres, dpost, dcomb, T, D, M,
                                             BT_TOK, BD)
        return dx, dres, dpost.to(ctx.dtypes[0]), dcomb.to(ctx.dtypes[1])


def hc_pre_fused(h, fn, scale, base, M: int, iters: int, eps: float, norm_eps: float):
    """Triton `model.hc_pre_reference`: h [B,S,M,D] -> (x [B,S,D], post [B,S,M], comb [B,S,M,M])."""
    return HcPre.apply(h, fn, scale, base, M, iters, eps, norm_eps)


def hc_post_fused(x, res, post, comb):
    """Triton `model.hc_post`: out_k = post_k x + sum_j comb[j,k] res_j.  -> [B,S,M,D]"""
    return HcPost.apply(x, res, post, comb)
