"""A decode step's attention pieces in Triton: the few launches the decode seam puts in place of long op chains.

A step of the rollout engine (64 rows, one token each, each row at its own position) is launch-bound: every op
costs the host tens of microseconds whatever its size, and the readable path (`model.Attention.forward`) issues
~70 ops per attention layer -- a norm is 6 ops, a rope 8, the masked sink softmax ~15, and a compressor's state
shift and pooling tens more. `model.Attention.decode_step` and `model.Compressor.decode_step` run the same math
through three kernels:

    rms_rope(x, weight, eps, cos, sin)      per row of D:  y = rope( w * x / sqrt(mean(x^2) + eps) ),
                                            `model.RMSNorm` then `model.apply_rope` on the last R dims
                                            (interleaved pairs (2i, 2i+1): the partner of element i is i ^ 1,
                                            loaded a second time); the norm, its weight and the rope each
                                            optional, `inverse` rotates back. One launch for each of: a layer
                                            norm, q's per-head RMS + rope, kv's norm + rope, a compressed entry's
                                            norm + rope, the output's inverse rope.
    decode_attention(q, window, pos, ...)   `model.Attention.attend` + `model.sink_attention` for ONE query per
                                            row: the row's window keys (right-aligned: a column before the row's
                                            position 0 is a shorter row's padding, masked), then the compressed
                                            entries it keeps -- a bool mask, or, without one, every entry whose
                                            window has ended (u < (p+1) // ratio: C128 layers, and C4 layers while
                                            the indexer keeps every entry) -- in one online softmax that starts
                                            from the per-head sink (as `attention._fwd`). One program per (row,
                                            block of heads).
    compress_step(state, kv, score, ape,    `model.Compressor.step_rows` for one token per row: ape[p mod m]
                  pos, prev, pool)          added to its score, the per-row state shifted by one slot, and
                                            (pool) each row's window softmax-pooled per channel over its m
                                            slots (C4: 2m slots, the previous window's first d channels with
                                            this one's last d), the window kept as `prev` where it ends. One
                                            program per (row, block of channels).

Numerics: everything in fp32 (loads upcast, dots as exact fp32 FMAs: input_precision "ieee"), rounded once to
the output dtype where the reference rounds (the norm's output is cast to the activation dtype before the rope,
as `RMSNorm` returns it). What differs from the reference is the order of fp32 operations only: the attention's
softmax online in exp2 (the pooling's online in exp), FMA contraction, the dot's summation order (~1e-7
relative; bf16 activations: q's per-head RMS, which the reference computes in bf16, here in fp32 then rounded
once).

Tests: `pytest tests/test_decode_kernels.py` (the interpreter cases against model.py -- each kernel, the
compressor step against `step_rows`, a whole decode; `-m gpu`: the same on CUDA at the `small` geometry).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoflash.kernels.attention import LOG2E, MIN_DOT, _fwd_step

# compress_step launch: 32 slots x 128 channels a step (a C128 window is 4 steps, a C4 one 1).
COMPRESS_CONFIG = dict(BLOCK_S=32, BLOCK_D=128, num_warps=4)
# decode_attention launch: 16 heads x 16 keys a step with the head dim (512) whole, fp32 in registers: q, one key
# block and the accumulator are 8192 values each, 32 registers a thread at 8 warps.
ATTN_CONFIG = dict(BLOCK_H=16, BLOCK_K=16, num_warps=8)


@triton.jit
def _rms_rope(X, WT, COS, SIN, Y, D, ROT, rows_per_angle, eps, sx, sy,
              NORM: tl.constexpr, WEIGHT: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr,
              BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    y = tl.load(X + n * sx + offs, mask=mask, other=0.0).to(tl.float32)
    if ROPE:
        partner = offs ^ 1                                      # the other element of i's interleaved pair
        yp = tl.load(X + n * sx + partner, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(y * y, 0) / D + eps)
        y = y * rstd
        if ROPE:
            yp = yp * rstd
        if WEIGHT:
            y = tl.load(WT + offs, mask=mask, other=0.0).to(tl.float32) * y
            if ROPE:
                yp = tl.load(WT + partner, mask=mask, other=0.0).to(tl.float32) * yp
        y = y.to(Y.dtype.element_ty).to(tl.float32)            # RMSNorm returns the activation dtype
        if ROPE:
            yp = yp.to(Y.dtype.element_ty).to(tl.float32)
    if ROPE:
        rot = mask & (offs >= D - ROT)
        j = (offs - (D - ROT)) // 2                             # the pair's angle (rope dims only)
        a = n // rows_per_angle
        c = tl.load(COS + a * (ROT // 2) + j, mask=rot, other=1.0)
        s = tl.load(SIN + a * (ROT // 2) + j, mask=rot, other=0.0)
        if INVERSE:
            s = -s
        # even i: x1 cos - x2 sin (x1 = y, x2 = yp);  odd i: x1 sin + x2 cos (x1 = yp, x2 = y)
        out = tl.where(offs % 2 == 0, y * c - yp * s, yp * s + y * c)
        y = tl.where(rot, out, y)
    tl.store(Y + n * sy + offs, y.to(Y.dtype.element_ty), mask=mask)


def rms_rope(x: torch.Tensor, weight=None, eps: float = 0.0, cos=None, sin=None, inverse: bool = False,
             norm: bool = True) -> torch.Tensor:
    """y = rope(norm(x)) per row of the last dim (module docstring): `norm` with `weight` (None: unweighted,
    q's per-head RMS), then, with cos / sin, the rotation of the last R dims (`inverse`: rotated back).
    Row n of x takes angle row n // (rows / angle rows): q [B,1,H,Dh] with cos [B,1,R/2] gives each head its row's
    angle. x [..., D] -> [..., D] in x's dtype; cos / sin [..., R/2] fp32"""
    D = x.shape[-1]
    xc = x.contiguous().view(-1, D)
    y = torch.empty(xc.shape, device=xc.device, dtype=xc.dtype)
    rope = cos is not None
    rot, per = (2 * cos.shape[-1], xc.shape[0] // (cos.numel() // cos.shape[-1])) if rope else (0, 1)
    if rope:
        cos, sin = cos.contiguous(), sin.contiguous()
        if rot > D or (D - rot) % 2 or xc.shape[0] % (cos.numel() // cos.shape[-1]):
            raise ValueError(f"rms_rope: x {tuple(x.shape)} does not fit rope angles {tuple(cos.shape)}")
    _rms_rope[(xc.shape[0],)](xc, weight if weight is not None else xc, cos if rope else xc, sin if rope else xc, y,
                              D, rot, per, eps, xc.stride(0), y.stride(0), NORM=norm, WEIGHT=weight is not None,
                              ROPE=rope, INVERSE=inverse, BLOCK_D=triton.next_power_of_2(D))
    return y.view(x.shape)


@triton.jit
def _decode_attn(Q, WIN, COMP, KEEP, POS, SINK, O, H, D, Lw, C, W, ratio, scale_log2,
                 sq_b, sq_h, sw_b, sw_l, sc_b, sc_c, sk_b, so_b, so_h,
                 HAS_COMP: tl.constexpr, HAS_KEEP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_k, offs_d = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_D)
    mask_h, mask_d = offs_h < H, offs_d < D
    q = tl.load(Q + b * sq_b + offs_h[:, None] * sq_h + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(tl.float32)     # [BH,BD]
    m = tl.load(SINK + offs_h, mask=mask_h, other=0.0).to(tl.float32) * 1.4426950408889634
    l = tl.full([BLOCK_H], 1.0, tl.float32)                                           # the sink's exp(0)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    p = tl.load(POS + b)
    # window column j holds position p - (Lw-1) + j: kept iff that is >= 0 and within W of p
    lo = tl.maximum(tl.maximum(Lw - 1 - p, Lw - W), 0)
    for start in range(lo, Lw, BLOCK_K):
        cols = start + offs_k
        valid = cols < Lw
        k = tl.load(WIN + b * sw_b + cols.to(tl.int64)[:, None] * sw_l + offs_d[None, :],
                    mask=valid[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # [BK,BD]
        m, l, acc = _fwd_step(q, k, valid, m, l, acc, scale_log2, PREC)
    if HAS_COMP:
        if HAS_KEEP:
            n = C
        else:                                                                          # entries whose window ended
            n = tl.minimum((p + 1) // ratio, C)
        for start in range(0, n, BLOCK_K):
            u = start + offs_k
            valid = u < n
            if HAS_KEEP:
                valid = valid & (tl.load(KEEP + b * sk_b + u, mask=valid, other=0) != 0)
            k = tl.load(COMP + b * sc_b + u.to(tl.int64)[:, None] * sc_c + offs_d[None, :],
                        mask=valid[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
            m, l, acc = _fwd_step(q, k, valid, m, l, acc, scale_log2, PREC)
    o = acc / l[:, None]
    tl.store(O + b * so_b + offs_h[:, None] * so_h + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=mask_h[:, None] & mask_d[None, :])


def decode_attention(q, window, pos, sink, scale: float, window_size: int, comp=None, keep=None, ratio: int = 0,
                     config=None) -> torch.Tensor:
    """One query per row over its window and compressed entries, one softmax with the sink (module docstring).

    Shapes: q [B,H,Dh], window [B,Lw,Dh] (right-aligned at each row's position), pos [B] int64 on q's device,
            sink [H], comp [B,C,Dh] or None, keep [B,C] bool or None (then entries u < (pos+1) // ratio)
            -> o [B,H,Dh] in q's dtype
    """
    B, H, D = q.shape
    if window.shape[0] != B or window.shape[2] != D or pos.shape != (B,) or (comp is not None and keep is None
                                                                             and ratio < 1):
        raise ValueError(f"decode_attention: q [B,H,Dh], window [B,Lw,Dh], pos [B] and keep or a ratio expected; "
                         f"got q {tuple(q.shape)}, window {tuple(window.shape)}, pos {tuple(pos.shape)}, "
                         f"ratio {ratio}")
    cfg = dict(config or ATTN_CONFIG)
    cfg["BLOCK_H"] = max(MIN_DOT, min(cfg["BLOCK_H"], triton.next_power_of_2(H)))
    q, window = q.contiguous(), window.contiguous()
    comp = comp.contiguous() if comp is not None else None
    o = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    has_comp, has_keep = comp is not None and comp.shape[1] > 0, keep is not None
    comp_t = comp if has_comp else window
    keep_t = keep.view(torch.uint8) if has_keep else pos
    _decode_attn[(B, triton.cdiv(H, cfg["BLOCK_H"]))](
        q, window, comp_t, keep_t, pos, sink, o, H, D, window.shape[1], comp_t.shape[1] if has_comp else 0,
        window_size, max(ratio, 1), scale * LOG2E, q.stride(0), q.stride(1), window.stride(0), window.stride(1),
        comp_t.stride(0), comp_t.stride(1), keep_t.stride(0) if has_keep else 0, o.stride(0), o.stride(1),
        HAS_COMP=has_comp, HAS_KEEP=has_keep and has_comp, BLOCK_D=max(MIN_DOT, triton.next_power_of_2(D)),
        PREC="ieee", **cfg)   # fp32 FMA dots whatever the dtype: the reference's sink softmax is fp32
    return o


@triton.jit
def _pool_step(g, k, mx, l, acc):
    """One block of slots [BS,BD] through a per-channel online softmax: -> (max, sum of exp, sum of exp * kv)."""
    m_new = tl.maximum(mx, tl.max(g, 0))
    alpha = tl.exp(mx - m_new)
    e = tl.exp(g - m_new[None, :])
    return m_new, l * alpha + tl.sum(e, 0), acc * alpha + tl.sum(e * k, 0)


@triton.jit
def _compress_step(SKV, SSC, KV, SC, APE, POS, PKV, PSC, OKV, OSC, ENT, QKV, QSC, m, d, c,
                   skv_b, skv_s, ssc_b, ssc_s, sx_b, spk_b, spk_s, sps_b, sps_s,
                   OVERLAP: tl.constexpr, POOL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)                          # the entry's channels
    cm, offs_s = ch < d, tl.arange(0, BLOCK_S)
    p = tl.load(POS + b)
    ends = (p + 1) % m == 0
    mx = tl.full([BLOCK_D], -3.0e38, tl.float32)                                      # finite: -inf slots add 0
    l = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for h in tl.static_range(2 if OVERLAP else 1):          # C4: channels [0, d) feed the next entry ("Ca")
        cc = h * d + ch
        for s0 in range(0, m - 1, BLOCK_S):                 # the state's m-1 slots: shifted left by one
            s = s0 + offs_s
            msk = (s < m - 1)[:, None] & cm[None, :]
            k = tl.load(SKV + b * skv_b + s[:, None] * skv_s + cc[None, :], mask=msk, other=0.0)
            g = tl.load(SSC + b * ssc_b + s[:, None] * ssc_s + cc[None, :], mask=msk, other=0.0)
            out = b * (m - 1) * c + (s - 1)[:, None] * c + cc[None, :]
            tl.store(OKV + out, k, mask=msk & (s >= 1)[:, None])
            tl.store(OSC + out, g, mask=msk & (s >= 1)[:, None])
            if POOL:
                if OVERLAP:                                 # a window that ends is the next one's "Ca"
                    prev = b * m * c + s[:, None] * c + cc[None, :]
                    pk = tl.load(PKV + b * spk_b + s[:, None] * spk_s + cc[None, :], mask=msk, other=0.0)
                    ps = tl.load(PSC + b * sps_b + s[:, None] * sps_s + cc[None, :], mask=msk, other=0.0)
                    tl.store(QKV + prev, tl.where(ends, k, pk), mask=msk)
                    tl.store(QSC + prev, tl.where(ends, g, ps), mask=msk)
                if h == (1 if OVERLAP else 0):
                    mx, l, acc = _pool_step(tl.where(msk, g, float("-inf")), k, mx, l, acc)
        kt = tl.load(KV + b * sx_b + cc, mask=cm, other=0.0)                          # this token: slot m-1
        gt = tl.load(SC + b * sx_b + cc, mask=cm, other=0.0) + tl.load(APE + (p % m) * c + cc, mask=cm, other=0.0)
        tl.store(OKV + b * (m - 1) * c + (m - 2) * c + cc, kt, mask=cm)
        tl.store(OSC + b * (m - 1) * c + (m - 2) * c + cc, gt, mask=cm)
        if POOL:
            if OVERLAP:
                pkt = tl.load(PKV + b * spk_b + (m - 1) * spk_s + cc, mask=cm, other=0.0)
                pst = tl.load(PSC + b * sps_b + (m - 1) * sps_s + cc, mask=cm, other=0.0)
                tl.store(QKV + b * m * c + (m - 1) * c + cc, tl.where(ends, kt, pkt), mask=cm)
                tl.store(QSC + b * m * c + (m - 1) * c + cc, tl.where(ends, gt, pst), mask=cm)
            if h == (1 if OVERLAP else 0):
                mx, l, acc = _pool_step(tl.where(cm, gt, float("-inf"))[None, :], kt[None, :], mx, l, acc)
    if POOL:
        if OVERLAP:                                         # "Ca": the previous window's first d channels
            for s0 in range(0, m, BLOCK_S):
                s = s0 + offs_s
                msk = (s < m)[:, None] & cm[None, :]
                k = tl.load(PKV + b * spk_b + s[:, None] * spk_s + ch[None, :], mask=msk, other=0.0)
                g = tl.load(PSC + b * sps_b + s[:, None] * sps_s + ch[None, :], mask=msk, other=float("-inf"))
                mx, l, acc = _pool_step(g, k, mx, l, acc)
        tl.store(ENT + b * d + ch, acc / l, mask=cm)


def compress_step(state_kv, state_score, kv, score, ape, pos, prev_kv=None, prev_score=None, pool: bool = True,
                  config=None):
    """`model.Compressor.decode_step`'s state and pooling in one launch (module docstring): this token's
    score gets ape[p mod m]; the state drops its oldest slot and appends the token; with `pool`, each row's window
    (the state's m-1 slots and the token) is softmax-pooled per channel over its m slots -- C4 (prev given):
    the last d channels of this window with the first d of the previous one, 2m slots -- and, C4, the window
    becomes `prev` where it ends ((p+1) mod m = 0). Rows whose window does not end get a pooled value too, unused.

    Shapes: state_kv / state_score [B,m-1,c] fp32 (right-aligned, per-row form), kv / score [B,1,c] fp32, ape
            [m,c] fp32, pos [B] int64; prev_kv / prev_score [B,m,c] (C4: c = 2d) -> (state kv, state score
            [B,m-1,c], entries [B,1,d] fp32 or None without `pool`, prev kv, prev score)
    """
    B, m1, c = state_kv.shape
    m, overlap = m1 + 1, prev_kv is not None
    d = c // 2 if overlap else c
    if kv.shape != (B, 1, c) or score.shape != (B, 1, c) or ape.shape != (m, c) or pos.shape != (B,) or (
            overlap and prev_kv.shape != (B, m, c)):
        raise ValueError(f"compress_step: state [B,m-1,c], kv / score [B,1,c], ape [m,c], pos [B], prev [B,m,c] "
                         f"expected; got state {tuple(state_kv.shape)}, kv {tuple(kv.shape)}, ape {tuple(ape.shape)}, "
                         f"pos {tuple(pos.shape)}, prev {None if prev_kv is None else tuple(prev_kv.shape)}")
    cfg = dict(config or COMPRESS_CONFIG)
    cfg["BLOCK_D"] = min(cfg["BLOCK_D"], triton.next_power_of_2(d))
    cfg["BLOCK_S"] = min(cfg["BLOCK_S"], triton.next_power_of_2(m))
    skv, ssc = (t.contiguous() if t.stride(-1) != 1 else t for t in (state_kv, state_score))
    kv, score = kv.contiguous(), score.contiguous()          # one batch stride serves both (the kernel's sx_b)
    ape = ape.float().contiguous()
    f32 = dict(device=kv.device, dtype=torch.float32)
    new_kv, new_score = torch.empty(B, m1, c, **f32), torch.empty(B, m1, c, **f32)
    ent = torch.empty(B, 1, d, **f32) if pool else None
    pk, ps = (prev_kv.contiguous(), prev_score.contiguous()) if overlap else (kv, score)
    qk, qs = (torch.empty(B, m, c, **f32), torch.empty(B, m, c, **f32)) if overlap and pool else (pk, ps)
    _compress_step[(B, triton.cdiv(d, cfg["BLOCK_D"]))](
        skv, ssc, kv, score, ape, pos, pk, ps, new_kv, new_score, ent if pool else kv, qk, qs, m, d, c,
        skv.stride(0), skv.stride(1), ssc.stride(0), ssc.stride(1), kv.stride(0),
        pk.stride(0), pk.stride(1) if overlap else 0, ps.stride(0), ps.stride(1) if overlap else 0,
        OVERLAP=overlap, POOL=pool, **cfg)
    return new_kv, new_score, ent, (qk if overlap else None), (qs if overlap else None)
