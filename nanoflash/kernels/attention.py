"""V4 sparse attention in Triton: each query attends to its window and to a list of compressed entries.

What one query t (of B*S) and head h compute -- the same function as `model.sink_attention` over the keys
`model.Attention.attend` masks in, but touching only the keys that are used:

    keys(t)  = kv[t-W+1 .. t]  (the sliding window, rows < 0 dropped)  U  comp[sel[t, :]]  (sel -1 padded)
    l_j      = scale * q_h . k_j                                   (K = V: one shared head of dim Dh)
    p_j      = exp(l_j) / (sum_j exp(l_j) + exp(sink_h))           (the sink only adds to the denominator)
    o_h      = sum_j p_j k_j,        lse_h = log(sum_j exp(l_j) + exp(sink_h))

Forward (`_fwd`): one program per (query, block of heads) loads q [BH, Dh] once and streams the keys in
blocks of BK rows -- contiguous rows for the window, gathered rows for the selection -- through an online
softmax that starts from the sink (m = sink, l = 1), so a query with no keys returns 0 and no -inf appears.
Dots run on the tensor cores in the input dtype (bf16) with fp32 accumulation; p is rounded to the input
dtype for the p.v dot (as in FlashAttention). Only o and lse [B,S,H] are saved: activation memory is
O(S (W + k)) (the index list) instead of the reference's O(S^2) masks and logits.
`_fwd_keys` (a config with kind="keys", FWD_KEYS_CONFIG) is the same function with the keys on the MMA's M
dimension: s^T = k q^T [BK, heads] and o^T += k^T p^T in two head-dim halves, so on Hopper no warpgroup repeats
another's rows (`_fwd`'s 64-row s feeds the p.v dot, and Triton then puts all 8 warps on M). Not the default.

Backward (`_bwd`), with delta_h = dO_h . o_h (computed in the kernel) and ds_j = p_j (dO . k_j - delta):

    dq_h   = scale * sum_j ds_j k_j
    dkv_j  = sum_h p_j dO_h + scale * ds_j q_h      (V and K are the same tensor: both terms land in one)
    dsink_h = -sum_t exp(sink_h - lse_h) delta_h    (torch, from the kernel's delta)

dq is accumulated in registers per query. dkv rows are shared by many queries, so they are added with fp32
atomics (`fused=True`: one kernel does both; `fused=False`: a dq kernel and a dkv kernel, which lowers the
register pressure of each at the cost of recomputing p). Atomics make dkv's last bits depend on the order of
addition: the deterministic path is the reference (`ModelConfig.kernels="reference"`).

Shapes: q [B,S,H,Dh], kv [B,S,Dh], comp [B,C,Dh], sel [B|1,S,K] int (entries < C, -1 = none), sink [H]
        -> o [B,S,H,Dh] (q's dtype)

Tests: `pytest tests/test_kernels_attention.py` (CPU, Triton interpreter) and
`tests/test_kernels_attention_gpu.py` (H200, real geometry). Speed: `bench/bench_attention.py`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nanoflash.kernels import target as tgt
from nanoflash.kernels.attention_bwd import attention_backward_wgmma

LOG2E = math.log2(math.e)
# Launch configurations (BLOCK_H heads x BLOCK_K keys per step, warps, pipeline stages): the fastest of
# bench/bench_attention.py's sweep on an H200 at 64 heads x 512 (docs/benchmarks.md K1); small shapes get
# smaller blocks (`_blocks`). 64 heads use wgmma; the backward holds q and dO twice in shared memory (as A and
# B operands), so 64 heads do not fit in 227 KB there: it runs on 32 heads per program (two programs per
# query, each adding its share of dkv), fused (one pass) -- the split dq / dkv passes measured slower.
FWD_CONFIG = dict(BLOCK_H=64, BLOCK_K=64, num_warps=8, num_stages=2)
# The keys-on-M forward (`_fwd_keys`, kind="keys"): 128 keys on the MMA's M dimension, s^T = k q^T, so no
# warpgroup computes another's rows (`_fwd`'s s [64 heads, 64 keys] feeds the p.v dot, so all 8 warps sit on
# M = 64 and both warpgroups compute the same rows). Head dim in two halves; one stage (the 128 x 512 key
# block alone is 128 KiB). Not the default: measured slower (H100, 2026-12-07: 4.19 ms against `_fwd`'s 2.80 at
# S = 8192 on C4, its spills costing more than the rows it saves; docs/benchmarks.md).
FWD_KEYS_CONFIG = dict(kind="keys", BLOCK_H=64, BLOCK_K=128, num_warps=8, num_stages=1)
FUSED_BWD_CONFIG = dict(fused=True, dq=dict(BLOCK_H=32, BLOCK_K=32, num_warps=8, num_stages=2),
                        dkv=dict(BLOCK_H=32, BLOCK_K=32, num_warps=8, num_stages=2))
# The wgmma backward (attention_bwd.py: a dq pass, a key-major dkv pass, an entry pass), selected by
# kind="wgmma". Shared memory at 64 heads x 512 (ptxas, sm_90a): dq 64 heads x 32 keys, 2 stages = 208 KiB (the
# interleaved (q, dO) rows 128 KiB + 2 x 32 KiB keys); dkv / entry keys 64 keys x 64 rows, 1 stage = 224 KiB;
# entry rows 64 heads x 64 entries, 1 stage = 192 KiB; every pass 8 warps: Hopper only (sm_90: 227 KiB; an
# A100 has 164 KiB).
WGMMA_BWD_CONFIG = dict(kind="wgmma", dq=dict(BLOCK_H=64, BLOCK_K=32, num_warps=8, num_stages=2),
                        dkv=dict(BLOCK_K=64, BLOCK_R=64, num_warps=8, num_stages=1, programs=264, min_chunk=32),
                        comp=dict(BLOCK_K=64, BLOCK_R=64, num_warps=8, num_stages=1, chunk=64, comp_mode="auto",
                                  keys_min_fill=1.0,
                                  rows=dict(BLOCK_H=64, BLOCK_K=64, num_warps=8, num_stages=1)))
# The default backward on Hopper: the wgmma passes with the entries query-major ("m128-rows"), the fastest
# candidate or within 1% of it on C4 / C128 layers and within 3% on sliding ones in bench/bench_attention.py --bwd
# on an H200 (2026-12-03,
# docs/results/attention_bwd_h200.json: 1.01-1.48x the fused backward's fwd+bwd, C4 at S = 8192 0.228 of the
# matmul ceiling against 0.154). Other CUDA GPUs keep the fused backward.
HOPPER_BWD_CONFIG = dict(WGMMA_BWD_CONFIG, comp=dict(WGMMA_BWD_CONFIG["comp"], comp_mode="rows"))
BWD_CONFIG = None   # None: the target's default (above); a dict (the bench's sweep, the tests) wins everywhere
# AMD, per gfx arch (unknown archs get gfx942's: the smaller LDS). On CDNA a workgroup of num_warps waves must
# fit one CU (4 SIMDs): 8 waves cap a lane at 256 VGPRs, 4 waves at 512 (256 VGPRs + 256 AGPRs). The H200 configs
# at head_dim 512 spill there (gfx950: 456 VGPRs spilled / 1,436 bytes of scratch a lane forward, 530 / 1,864
# backward; gfx942 also overflows its 64 KiB LDS forward) -- so 4 waves and smaller blocks, the largest that
# compile with no spill and no scratch (tests/test_kernels_compile_targets.py; VGPRs at the flash shapes):
#   forward   gfx950 64 heads x 32 keys, 1 stage: 453 VGPRs, 64 KiB LDS (64 heads: each key block read once
#             per query, as on the H200); gfx942 16 x 32, 2 stages: 351 VGPRs, 32 KiB (64 x 32 and 32 x 32
#             spill there)
#   backward  16 heads x 16 keys, fused, 1 stage: 385 (gfx950) / 452 (gfx942) VGPRs, 32 KiB; 32-head and
#             split dq / dkv variants spill on both.
# Not yet timed on AMD hardware (docs/amd.md): no spill is the floor, not the optimum.
AMD_FWD_CONFIG = {"gfx950": dict(BLOCK_H=64, BLOCK_K=32, num_warps=4, num_stages=1),
                  "gfx942": dict(BLOCK_H=16, BLOCK_K=32, num_warps=4, num_stages=2)}
_AMD_BWD = dict(BLOCK_H=16, BLOCK_K=16, num_warps=4, num_stages=1)
AMD_BWD_CONFIG = {arch: dict(fused=True, dq=_AMD_BWD, dkv=_AMD_BWD) for arch in ("gfx950", "gfx942")}
AMD_DEFAULT_ARCH = "gfx942"
MIN_DOT = 16   # tl.dot needs every dimension >= 16


@triton.jit
def _fwd_step(q, k, valid, m, l, acc, scale_log2, PREC: tl.constexpr):
    """One block of keys [BK,BD] through the online softmax. -> (m, l, acc) updated"""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2                      # [BH,BK] log2 units
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PREC)
    return m_new, l * alpha + tl.sum(p, 1), acc


@triton.jit
def _fwd(Q, KV, COMP, SEL, NSEL, SINK, O, LSE,
         sq_b, sq_s, sq_h, skv_b, skv_s, sc_b, sc_c, ss_b, ss_s, sn_b,
         S, H, D, W, scale_log2,
         HAS_COMP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
         PREC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b, t = pid // S, pid % S
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_k, offs_d = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_D)
    mask_h, mask_d = offs_h < H, offs_d < D
    q_ptr = Q + b * sq_b + t * sq_s + offs_h[:, None] * sq_h + offs_d[None, :]
    q = tl.load(q_ptr, mask=mask_h[:, None] & mask_d[None, :], other=0.0)              # [BH,BD]
    m = tl.load(SINK + offs_h, mask=mask_h, other=0.0).to(tl.float32) * 1.4426950408889634
    l = tl.full([BLOCK_H], 1.0, tl.float32)                                            # the sink's exp(0)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    lo = tl.maximum(t - W + 1, 0)
    for start in range(lo, t + 1, BLOCK_K):                                            # window: rows of kv
        rows = start + offs_k
        valid = rows <= t
        k = tl.load(KV + b * skv_b + rows.to(tl.int64)[:, None] * skv_s + offs_d[None, :],
                    mask=valid[:, None] & mask_d[None, :], other=0.0)                  # [BK,BD]
        m, l, acc = _fwd_step(q, k, valid, m, l, acc, scale_log2, PREC)
    if HAS_COMP:
        n_sel = tl.load(NSEL + b * sn_b + t)
        for start in range(0, n_sel, BLOCK_K):                                         # selection: rows of comp
            valid = start + offs_k < n_sel
            j = tl.load(SEL + b * ss_b + t * ss_s + start + offs_k, mask=valid, other=0).to(tl.int64)
            k = tl.load(COMP + b * sc_b + j[:, None] * sc_c + offs_d[None, :],
                        mask=valid[:, None] & mask_d[None, :], other=0.0)
            m, l, acc = _fwd_step(q, k, valid, m, l, acc, scale_log2, PREC)
    o = acc / l[:, None]
    o_ptr = O + b * sq_b + t * sq_s + offs_h[:, None] * sq_h + offs_d[None, :]
    tl.store(o_ptr, o.to(O.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
    tl.store(LSE + pid * H + offs_h, m + tl.log2(l), mask=mask_h)                      # log2 units


@triton.jit
def _fwd_keys_step(q_lo, q_hi, row, offs_lo, offs_hi, mask_lo, mask_hi, valid, m, l, acc_lo, acc_hi, scale_log2,
                   PREC: tl.constexpr):
    """One block of keys (rows at row [BK,1], two head-dim halves [BK,BD/2]) with the keys on M: s^T = k q^T
    [BK,BH], then o^T [BD/2,BH] += k^T p^T per half. -> (m, l, acc_lo, acc_hi) updated (m, l per head)
    The hi half is loaded after the lo half's dot is issued, so the two [BK,BD/2] tiles do not wait in
    registers together beside the 128 registers of accumulators (ptxas sm_90a, C4: spills 996 / 916 bytes a
    thread stored / loaded with both loaded first, 808 / 736 so)."""
    k_lo = tl.load(row + offs_lo[None, :], mask=valid[:, None] & mask_lo[None, :], other=0.0)
    st = tl.dot(k_lo, tl.trans(q_lo), input_precision=PREC)
    k_hi = tl.load(row + offs_hi[None, :], mask=valid[:, None] & mask_hi[None, :], other=0.0)
    st = tl.dot(k_hi, tl.trans(q_hi), st, input_precision=PREC)
    st = tl.where(valid[:, None], st * scale_log2, float("-inf"))                      # [BK,BH] log2 units
    m_new = tl.maximum(m, tl.max(st, 0))
    alpha = tl.exp2(m - m_new)
    pt = tl.exp2(st - m_new[None, :])
    ptk = pt.to(k_lo.dtype)
    acc_lo = tl.dot(tl.trans(k_lo), ptk, acc_lo * alpha[None, :], input_precision=PREC)
    acc_hi = tl.dot(tl.trans(k_hi), ptk, acc_hi * alpha[None, :], input_precision=PREC)
    return m_new, l * alpha + tl.sum(pt, 0), acc_lo, acc_hi


@triton.jit
def _fwd_keys(Q, KV, COMP, SEL, NSEL, SINK, O, LSE,
              sq_b, sq_s, sq_h, skv_b, skv_s, sc_b, sc_c, ss_b, ss_s, sn_b,
              S, H, D, W, scale_log2,
              HAS_COMP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
              PREC: tl.constexpr):
    """`_fwd` with the keys on the MMA's M dimension (same grid, same o and lse): the accumulator is o^T
    [BD,BH] in two halves, the softmax statistics run down the key axis (axis 0)."""
    HD: tl.constexpr = BLOCK_D // 2
    pid = tl.program_id(0).to(tl.int64)
    b, t = pid // S, pid % S
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_k, offs_lo = tl.arange(0, BLOCK_K), tl.arange(0, HD)
    offs_hi = HD + offs_lo
    mask_h, mask_lo, mask_hi = offs_h < H, offs_lo < D, offs_hi < D
    q_row = Q + b * sq_b + t * sq_s + offs_h[:, None] * sq_h
    q_lo = tl.load(q_row + offs_lo[None, :], mask=mask_h[:, None] & mask_lo[None, :], other=0.0)   # [BH,BD/2]
    q_hi = tl.load(q_row + offs_hi[None, :], mask=mask_h[:, None] & mask_hi[None, :], other=0.0)
    m = tl.load(SINK + offs_h, mask=mask_h, other=0.0).to(tl.float32) * 1.4426950408889634
    l = tl.full([BLOCK_H], 1.0, tl.float32)                                            # the sink's exp(0)
    acc_lo = tl.zeros([HD, BLOCK_H], tl.float32)                                       # o^T, head-dim halves
    acc_hi = tl.zeros([HD, BLOCK_H], tl.float32)
    for start in range(tl.maximum(t - W + 1, 0), t + 1, BLOCK_K):                     # window: rows of kv
        rows = start + offs_k
        valid = rows <= t
        row = KV + b * skv_b + rows.to(tl.int64)[:, None] * skv_s
        m, l, acc_lo, acc_hi = _fwd_keys_step(q_lo, q_hi, row, offs_lo, offs_hi, mask_lo, mask_hi, valid, m, l,
                                              acc_lo, acc_hi, scale_log2, PREC)
    if HAS_COMP:
        n_sel = tl.load(NSEL + b * sn_b + t)
        for start in range(0, n_sel, BLOCK_K):                                         # selection: rows of comp
            valid = start + offs_k < n_sel
            j = tl.load(SEL + b * ss_b + t * ss_s + start + offs_k, mask=valid, other=0).to(tl.int64)
            row = COMP + b * sc_b + j[:, None] * sc_c
            m, l, acc_lo, acc_hi = _fwd_keys_step(q_lo, q_hi, row, offs_lo, offs_hi, mask_lo, mask_hi, valid,
                                                  m, l, acc_lo, acc_hi, scale_log2, PREC)
    o_col = O + b * sq_b + t * sq_s + offs_h[None, :] * sq_h                          # o^T: [d, h]
    tl.store(o_col + offs_lo[:, None], (acc_lo / l[None, :]).to(O.dtype.element_ty),
             mask=mask_lo[:, None] & mask_h[None, :])
    tl.store(o_col + offs_hi[:, None], (acc_hi / l[None, :]).to(O.dtype.element_ty),
             mask=mask_hi[:, None] & mask_h[None, :])
    tl.store(LSE + pid * H + offs_h, m + tl.log2(l), mask=mask_h)                      # log2 units


@triton.jit
def _bwd_step(q, do, k, valid, kmask, lse, delta, dq, dst, scale, scale_log2, DO_DQ: tl.constexpr,
              DO_DKV: tl.constexpr, PREC: tl.constexpr):
    """One block of keys: dq += ds.k (returned); dkv rows at `dst` += p^T.dO + scale ds^T.q (atomics)."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    p = tl.where(valid[None, :], tl.exp2(s - lse[:, None]), 0.0)                       # [BH,BK]
    dp = tl.dot(do, tl.trans(k), input_precision=PREC)
    ds = p * (dp - delta[:, None])
    if DO_DQ:
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    if DO_DKV:
        dk = tl.dot(tl.trans(p.to(k.dtype)), do, input_precision=PREC)                 # [BK,BD]  (dV)
        dk = tl.dot(tl.trans((ds * scale).to(k.dtype)), q, dk, input_precision=PREC)   # + dK
        tl.atomic_add(dst, dk, mask=kmask, sem="relaxed")
    return dq


@triton.jit
def _bwd(Q, KV, COMP, SEL, NSEL, O, DO, LSE, DQ, DKV, DCOMP, DELTA,
         sq_b, sq_s, sq_h, skv_b, skv_s, sc_b, sc_c, ss_b, ss_s, sn_b,
         S, H, D, W, scale, scale_log2,
         HAS_COMP: tl.constexpr, DO_DQ: tl.constexpr, DO_DKV: tl.constexpr, BLOCK_H: tl.constexpr,
         BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b, t = pid // S, pid % S
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_k, offs_d = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_D)
    mask_h, mask_d = offs_h < H, offs_d < D
    mask_hd = mask_h[:, None] & mask_d[None, :]
    row = b * sq_b + t * sq_s + offs_h[:, None] * sq_h + offs_d[None, :]
    q = tl.load(Q + row, mask=mask_hd, other=0.0)                                       # [BH,BD]
    do = tl.load(DO + row, mask=mask_hd, other=0.0)
    delta = tl.sum(do.to(tl.float32) * tl.load(O + row, mask=mask_hd, other=0.0).to(tl.float32), 1)  # [BH]
    lse = tl.load(LSE + pid * H + offs_h, mask=mask_h, other=0.0)
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(tl.maximum(t - W + 1, 0), t + 1, BLOCK_K):                     # window: rows of kv
        rows = start + offs_k
        valid = rows <= t
        off = b * skv_b + rows.to(tl.int64)[:, None] * skv_s + offs_d[None, :]         # dkv: fp32, same strides
        kmask = valid[:, None] & mask_d[None, :]
        k = tl.load(KV + off, mask=kmask, other=0.0)                                   # [BK,BD]
        dq = _bwd_step(q, do, k, valid, kmask, lse, delta, dq, DKV + off, scale, scale_log2, DO_DQ, DO_DKV, PREC)
    if HAS_COMP:
        n_sel = tl.load(NSEL + b * sn_b + t)
        for start in range(0, n_sel, BLOCK_K):                                         # selection: rows of comp
            valid = start + offs_k < n_sel
            j = tl.load(SEL + b * ss_b + t * ss_s + start + offs_k, mask=valid, other=0).to(tl.int64)
            off = b * sc_b + j[:, None] * sc_c + offs_d[None, :]
            kmask = valid[:, None] & mask_d[None, :]
            k = tl.load(COMP + off, mask=kmask, other=0.0)
            dq = _bwd_step(q, do, k, valid, kmask, lse, delta, dq, DCOMP + off, scale, scale_log2, DO_DQ, DO_DKV,
                           PREC)
    if DO_DQ:
        tl.store(DQ + row, (dq * scale).to(DQ.dtype.element_ty), mask=mask_hd)
        tl.store(DELTA + pid * H + offs_h, delta, mask=mask_h)


def _blocks(H: int, D: int, cfg: dict) -> dict:
    """The launch config, shrunk to the problem (tests use a few heads of small dim). A "keys" forward splits
    the head dim in halves, each at least MIN_DOT wide."""
    bh = max(MIN_DOT, min(cfg["BLOCK_H"], triton.next_power_of_2(H)))
    bd = max(MIN_DOT * (2 if cfg.get("kind") == "keys" else 1), triton.next_power_of_2(D))
    return dict({k: v for k, v in cfg.items() if k != "kind"}, BLOCK_H=bh, BLOCK_D=bd)


def _strides(q, kv, comp, sel, n_sel):
    cs = (comp.stride(0), comp.stride(1)) if comp is not None else (0, 0)
    ss = (sel.stride(0) if sel.shape[0] > 1 else 0, sel.stride(1)) if sel is not None else (0, 0)
    ns = (n_sel.stride(0) if n_sel.shape[0] > 1 else 0,) if n_sel is not None else (0,)
    return (q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), *cs, *ss, *ns)


def launch_configs(target) -> tuple[dict, dict]:
    """(forward, backward) launch configs for a Triton target (None: CPU, the CUDA ones). Read at call time,
    so bench/bench_attention.py's sweep and the tests can set FWD_CONFIG / BWD_CONFIG."""
    if not tgt.is_amd(target):
        hopper = target is not None and target.backend == "cuda" and target.arch >= 90
        return FWD_CONFIG, BWD_CONFIG or (HOPPER_BWD_CONFIG if hopper else FUSED_BWD_CONFIG)
    arch = target.arch if target.arch in AMD_FWD_CONFIG else AMD_DEFAULT_ARCH
    return AMD_FWD_CONFIG[arch], AMD_BWD_CONFIG[arch]


def attention_forward(q, kv, comp, sel, n_sel, sink, scale: float, window: int, config=None):
    """Launch `_fwd` (or `_fwd_keys` for a config with kind="keys"). -> o [B,S,H,Dh], lse [B,S,H] fp32 in log2
    units"""
    B, S, H, D = q.shape
    target = tgt.device_target(q.device)
    config = config or launch_configs(target)[0]
    kernel = _fwd_keys if config.get("kind") == "keys" else _fwd
    cfg = _blocks(H, D, config)
    o = torch.empty_like(q)
    lse = torch.empty(B, S, H, device=q.device, dtype=torch.float32)
    dummy = kv  # never read when there is no selection (HAS_COMP=False)
    grid = (B * S, triton.cdiv(H, cfg["BLOCK_H"]))
    kernel[grid](q, kv, comp if comp is not None else dummy, sel if sel is not None else dummy,
               n_sel if n_sel is not None else dummy, sink, o, lse, *_strides(q, kv, comp, sel, n_sel),
               S, H, D, window, scale * LOG2E, HAS_COMP=comp is not None, PREC=tgt.dot_precision(q.dtype, target),
               **cfg)
    return o, lse


def attention_backward(do, q, kv, comp, sel, n_sel, o, lse, scale: float, window: int, config=None):
    """Launch `_bwd`: once fused (config "dq"), or a dq pass then a dkv pass. The dq pass writes delta.
    A config with kind="wgmma" runs `attention_bwd.attention_backward_wgmma` instead (key-major dkv).
    -> dq, dkv, dcomp (or None), delta [B,S,H]"""
    B, S, H, D = q.shape
    target = tgt.device_target(q.device)
    cfg = config or launch_configs(target)[1]
    if cfg.get("kind") == "wgmma":
        return attention_backward_wgmma(do, q, kv, comp, sel, n_sel, o, lse, scale, window, cfg)
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, device=kv.device, dtype=torch.float32)
    dcomp = torch.zeros(comp.shape, device=kv.device, dtype=torch.float32) if comp is not None else None
    delta = torch.empty(B, S, H, device=q.device, dtype=torch.float32)
    dummy = kv
    args = (q, kv, comp if comp is not None else dummy, sel if sel is not None else dummy,
            n_sel if n_sel is not None else dummy, o, do, lse, dq, dkv, dcomp if comp is not None else dkv, delta,
            *_strides(q, kv, comp, sel, n_sel), S, H, D, window, scale, scale * LOG2E)
    passes = [("dq", True, True)] if cfg["fused"] else [("dq", True, False), ("dkv", False, True)]
    for name, do_dq, do_dkv in passes:
        blocks = _blocks(H, D, cfg[name])
        _bwd[(B * S, triton.cdiv(H, blocks["BLOCK_H"]))](*args, HAS_COMP=comp is not None, DO_DQ=do_dq,
                                                          DO_DKV=do_dkv, PREC=tgt.dot_precision(q.dtype, target),
                                                          **blocks)
    return dq, dkv.to(kv.dtype), dcomp.to(comp.dtype) if comp is not None else None, delta


class _SparseAttention(torch.autograd.Function):
    """autograd seam: saves q, kv, comp, the index list, o and lse; the backward launches `_bwd`."""

    @staticmethod
    def forward(ctx, q, kv, comp, sel, n_sel, sink, scale, window):
        o, lse = attention_forward(q, kv, comp, sel, n_sel, sink, scale, window)
        ctx.save_for_backward(q, kv, comp, sel, n_sel, sink, o, lse)
        ctx.scale, ctx.window = scale, window
        return o

    @staticmethod
    def backward(ctx, do):
        q, kv, comp, sel, n_sel, sink, o, lse = ctx.saved_tensors
        dq, dkv, dcomp, delta = attention_backward(do.contiguous(), q, kv, comp, sel, n_sel, o, lse,
                                                   ctx.scale, ctx.window)
        p_sink = torch.exp2(sink.float() * LOG2E - lse)                                # [B,S,H]
        dsink = -(p_sink * delta).sum((0, 1)).to(sink.dtype)
        return dq, dkv, dcomp, None, None, dsink, None, None


def compact_selection(sel: torch.Tensor, n_entries: int):
    """Move each row's entries to the front in ascending order (the kernel walks a valid prefix; ascending
    rows also read memory in order). Checks the list. sel [B|1,S,K] -> (sel int32, n_sel [B|1,S] int32)"""
    big = torch.iinfo(torch.int32).max
    s = torch.where(sel < 0, big, sel.to(torch.int32)).sort(-1).values
    n_sel = (s != big).sum(-1, dtype=torch.int32)
    s = torch.where(s == big, -1, s)
    if s.numel():
        dup = ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any()
        top, dup = torch.stack([s.amax(), dup.to(s.dtype)]).tolist()                   # one host sync
        if top >= n_entries or dup:
            raise ValueError(f"sparse_attention: sel must list entries < comp.shape[1]={n_entries}, each at most "
                             f"once per query, -1 for none; got max {top}{' and duplicates' if dup else ''}")
    return s.contiguous(), n_sel.contiguous()


def _check(q, kv, sink, window, comp, sel):
    if q.dim() != 4 or kv.dim() != 3 or kv.shape[0] != q.shape[0] or kv.shape[1:] != (q.shape[1], q.shape[3]):
        raise ValueError(f"sparse_attention: q [B,S,H,Dh] and kv [B,S,Dh] expected, got q {tuple(q.shape)}, "
                         f"kv {tuple(kv.shape)}")
    if sink.shape != (q.shape[2],):
        raise ValueError(f"sparse_attention: sink must be [H={q.shape[2]}], got {tuple(sink.shape)}")
    if window < 1:
        raise ValueError(f"sparse_attention: window={window} must be >= 1 (the query itself)")
    if (comp is None) != (sel is None):
        raise ValueError("sparse_attention: comp and sel come together (both or neither)")
    if comp is not None and (comp.dim() != 3 or comp.shape[0] != q.shape[0] or comp.shape[2] != q.shape[3]):
        raise ValueError(f"sparse_attention: comp must be [B={q.shape[0]},C,Dh={q.shape[3]}], got {tuple(comp.shape)}")
    if sel is not None and (sel.dim() != 3 or sel.shape[0] not in (1, q.shape[0]) or sel.shape[1] != q.shape[1]
                            or sel.dtype.is_floating_point):
        raise ValueError(f"sparse_attention: sel must be an integer [B|1,S={q.shape[1]},K], got "
                         f"{tuple(sel.shape)} {sel.dtype}")
    dts = {t.dtype for t in (q, kv) + ((comp,) if comp is not None else ())}
    devs = {t.device for t in (q, kv, sink) + ((comp, sel) if comp is not None else ())}
    if len(dts) != 1 or len(devs) != 1:
        raise ValueError(f"sparse_attention: q, kv, comp need one dtype and one device, got {dts} on {devs}")


def sparse_attention(q, kv, sink, scale: float, window: int, comp=None, sel=None, prefix: bool = False):
    """Sink attention of query t over kv[t-W+1..t] and comp[sel[t]] (see the module docstring).

    q [B,S,H,Dh] (query t at position t), kv [B,S,Dh] (the shared K=V head, row t = position t),
    sink [H], comp [B,C,Dh] and sel [B|1,S,K] (entries of comp, -1 padded) or both None -> [B,S,H,Dh]

    prefix=True: the caller guarantees every row of sel lists distinct entries < C first and only -1 after
    them (model.py's lists are so by construction: the indexer's sorted top-k, the C128 visible prefix), so
    the sort and the checks (one host sync) are skipped; otherwise any -1 padded list is compacted and checked."""
    _check(q, kv, sink, window, comp, sel)
    n_sel = None
    if comp is not None and prefix:
        sel = sel.to(torch.int32).contiguous()
        n_sel = (sel >= 0).sum(-1, dtype=torch.int32)
    elif comp is not None:
        sel, n_sel = compact_selection(sel, comp.shape[1])
    if comp is not None:
        comp = comp.contiguous()
    return _SparseAttention.apply(q.contiguous(), kv.contiguous(), comp, sel, n_sel, sink, scale, window)


def window_and_selection_mask(S: int, window: int, sel=None, n_entries: int = 0, device=None) -> torch.Tensor:
    """The same key lists as a dense mask over [S window keys | C entries], the form `model.sink_attention`
    takes (tests and the FlexAttention benchmark use it). -> [B|1,S,S+C] bool, on sel's device (or `device`)"""
    t = torch.arange(S, device=sel.device if sel is not None else device)
    dist = t[:, None] - t[None, :]
    mask = ((dist >= 0) & (dist < window))[None]                                       # [1,S,S]
    if sel is None:
        return mask
    chosen = torch.zeros(*sel.shape[:2], n_entries + 1, dtype=torch.bool, device=sel.device)
    chosen.scatter_(-1, torch.where(sel < 0, n_entries, sel).long(), True)            # -1 -> a spare column
    return torch.cat([mask.expand(sel.shape[0], -1, -1), chosen[..., :n_entries]], -1)
