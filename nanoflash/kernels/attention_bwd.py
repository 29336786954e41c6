"""The backward of V4 sparse attention on Hopper's wgmma: passes that each own ONE [64, 512] fp32 accumulator.

The math is `attention.py`'s (its module docstring). With delta_h = dO_h . o_h, p_j = exp2(s_j - lse) and
ds_j = p_j (dO_h . k_j - delta_h), for query t, head h and key j (K = V: one shared head of dim 512):

    dq_th = scale sum_j ds_thj k_j                       over the query's window keys and selected entries
    dkv_j = sum_(t,h) p_thj dO_th + scale ds_thj q_th    over the queries t that see key j, every head h

Why passes. At V4's geometry (64 query heads share one K=V head of dim 512) one program cannot hold both a
dq [64 heads, 512] and a dkv [64 keys, 512] accumulator in fp32 registers (2 x 128 KiB = the register file),
and a query-major dkv contracts over only one query's 64 heads before each fp32 atomic write (2 KiB per key
per query). So each pass owns one accumulator and every dot runs on wgmma (M = 64 rows per warpgroup):

    _bwd_delta        delta = rows of o . dO (fp32). With cfg["dq"]["fuse_delta"] the dq pass (the first) computes
                      and writes it instead, one launch and one read of dO fewer.
    _bwd_dq           QUERY-major, program = (query, 64 heads): dq [64,512] += ds k over the window rows and
                      the selected entries, keys streamed in blocks of BLOCK_K (the forward's loop).
    _bwd_dkv          KEY-major, program = (block of BLOCK_K keys, chunk of the queries that see them): the
                      keys stay in shared memory, the queries' (q, dO) rows stream through, dkv [BK,512]
                      accumulates over all of them, then ONE plain store (one chunk) or fp32 atomic add (one
                      per chunk, ~64 queries x 64 heads, not one per query). Window: key block [j0, j0+BK) is
                      seen by queries [j0, j0+BK+W-1), a bounded range (its two edge triangles are computed
                      and masked: (BK+W-1)/W of the pairs). Entries: the queries that selected an entry of the
                      block come from per-block lists and a 64-bit word per (query, block) says which
                      (`selection_lists`); chunks are absolute query ranges, so programs launched together
                      read the same rows.
    _bwd_dcomp_rows   QUERY-major alternative for the entries, for sparse selections where a block's queries
                      keep few of its entries (C4 at long S): per query its entries in blocks of BLOCK_K, each
                      [BK,512] tile added with fp32 atomics. `comp_mode`: "keys", "rows" or "auto".

Two layout rules from Triton 3.6's code generation (checked on the compiled cuda:90 kernels, see
tests/test_kernels_compile_targets.py):
  * a dot whose result feeds another dot ("chained": s -> p -> p^T dO) gets all warps on M; with 8 warps and
    M = 64 both warpgroups then compute the same 64 rows. So s and dp are ONE dot over an interleaved row
    tile X = (q_0, dO_0, q_1, dO_1, ...) of 2 x 64 rows (`_rows`, `_split`): M = 128, no duplicate work.
  * the two dkv dots p^T dO + scale ds^T q are ONE dot Z^T X with Z interleaved like X (`_z`): a second dot
    accumulating into the first's result would be "chained" too, and the accumulator would change layout.

Dots per (query, head, key) pair: dq pass 3 (s, dp, dq), dkv / entry pass 4 (s, dp, dV, dK): 7 against the
fused backward's 5, but on wgmma and without per-pair atomics. Precision as `attention.py`: bf16 operands (p
and ds rounded to bf16), fp32 accumulation, one bf16 rounding of each gradient.

Selected by attention.py's config (kind="wgmma"). Tests: tests/test_kernels_attention.py (interpreter, every
mode), tests/test_kernels_attention_gpu.py (H200, the real geometry), tests/test_kernels_compile_targets.py
(cuda:90: wgmma, shared memory, no duplicated warpgroup rows). Speed: `bench/bench_attention.py --bwd`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoflash.kernels import target as tgt

MIN_DOT = 16          # tl.dot needs every dimension >= 16
WORD_BITS = 64        # one int64 word per (query, entry block): BLOCK_K of the entry pass is at most this
DELTA_ROWS = 16       # rows of o . dO per program of _bwd_delta
DELTA_COLS = 64       # head-dim slice of the dq pass's fused delta (fuse_delta=True; 16 also spills nothing)


@triton.jit
def _bwd_delta(O, DO, DELTA, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta[r] = sum_d o[r, d] dO[r, d] in fp32, over the rows r of [B*S*H, D] (contiguous)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (offs_d < D)[None, :]
    off = rows[:, None] * D + offs_d[None, :]
    o = tl.load(O + off, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, 1), mask=rows < R)


@triton.jit
def _rows(Q, DO, base, offs_x, h0, H, sq_h, offs_d, mask_d):
    """The interleaved row tile X [2R,BD] of one query: X[2i] = q[h0+i], X[2i+1] = dO[h0+i] (zero past H).
    One A operand for s and dp together (M = 2R: 128 rows at 64 heads, see _split)."""
    h = h0 + offs_x // 2
    off = base + h[:, None] * sq_h + offs_d[None, :]
    mask = (h < H)[:, None] & mask_d[None, :]
    return tl.load(tl.where((offs_x % 2 == 0)[:, None], Q + off, DO + off), mask=mask, other=0.0)


@triton.jit
def _split(sd, R: tl.constexpr, BK: tl.constexpr):
    """[2R,BK] rows (s_0, dp_0, s_1, dp_1, ...) -> s, dp [R,BK]."""
    return tl.split(tl.permute(tl.reshape(sd, [R, 2, BK]), (0, 2, 1)))


@triton.jit
def _dq_step(x, k, valid, lse, delta, dq, scale_log2, BH: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """One block of keys [BK,BD] for dq [BH,BD]: (s, dp) = X k^T in one dot, dq += ds k."""
    s, dp = _split(tl.dot(x, tl.trans(k), input_precision=PREC), BH, BK)                # [BH,BK] each
    p = tl.where(valid[None, :], tl.exp2(s * scale_log2 - lse[:, None]), 0.0)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)


@triton.jit
def _bwd_dq(Q, KV, COMP, SEL, NSEL, DO, O, LSE, DELTA, DQ,
            sq_b, sq_s, sq_h, skv_b, skv_s, sc_b, sc_c, ss_b, ss_s, sn_b,
            S, H, D, W, scale, scale_log2,
            HAS_COMP: tl.constexpr, FUSE_DELTA: tl.constexpr, DELTA_COLS: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    """Query-major dq: program (b * S + t, head block) holds X (its q, dO rows) and dq [BH, D], streams the
    window rows of kv and the selected rows of comp in blocks of BLOCK_K (as `attention._fwd`).
    FUSE_DELTA: delta = rows of o . dO is computed here (before the loop) and written to DELTA for the passes
    after this one, instead of read from `_bwd_delta`'s output (O has q's strides)."""
    pid = tl.program_id(0).to(tl.int64)
    b, t = pid // S, pid % S
    h0 = tl.program_id(1) * BLOCK_H
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_k, offs_d = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_D)
    mask_h, mask_d = offs_h < H, offs_d < D
    base = b * sq_b + t * sq_s
    x = _rows(Q, DO, base, tl.arange(0, 2 * BLOCK_H), h0, H, sq_h, offs_d, mask_d)      # [2BH,BD]
    lse = tl.load(LSE + pid * H + offs_h, mask=mask_h, other=0.0)
    if FUSE_DELTA:   # in head-dim slices of DELTA_COLS: whole [BH, BD] o and dO rows would spill registers
        delta = tl.zeros([BLOCK_H], tl.float32)
        offs_c = tl.arange(0, DELTA_COLS)
        for d0 in range(0, D, DELTA_COLS):
            off = base + offs_h[:, None] * sq_h + d0 + offs_c[None, :]
            mask_hc = mask_h[:, None] & (d0 + offs_c < D)[None, :]
            o = tl.load(O + off, mask=mask_hc, other=0.0).to(tl.float32)
            delta += tl.sum(o * tl.load(DO + off, mask=mask_hc, other=0.0).to(tl.float32), 1)   # [BH]
        tl.store(DELTA + pid * H + offs_h, delta, mask=mask_h)
    else:
        delta = tl.load(DELTA + pid * H + offs_h, mask=mask_h, other=0.0)
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(tl.maximum(t - W + 1, 0), t + 1, BLOCK_K):                     # window: rows of kv
        rows = start + offs_k
        valid = rows <= t
        k = tl.load(KV + b * skv_b + rows.to(tl.int64)[:, None] * skv_s + offs_d[None, :],
                    mask=valid[:, None] & mask_d[None, :], other=0.0)                  # [BK,BD]
        dq = _dq_step(x, k, valid, lse, delta, dq, scale_log2, BLOCK_H, BLOCK_K, PREC)
    if HAS_COMP:
        n_sel = tl.load(NSEL + b * sn_b + t)
        for start in range(0, n_sel, BLOCK_K):                                         # selection: rows of comp
            valid = start + offs_k < n_sel
            j = tl.load(SEL + b * ss_b + t * ss_s + start + offs_k, mask=valid, other=0).to(tl.int64)
            k = tl.load(COMP + b * sc_b + j[:, None] * sc_c + offs_d[None, :],
                        mask=valid[:, None] & mask_d[None, :], other=0.0)
            dq = _dq_step(x, k, valid, lse, delta, dq, scale_log2, BLOCK_H, BLOCK_K, PREC)
    out = base + offs_h[:, None] * sq_h + offs_d[None, :]
    tl.store(DQ + out, (dq * scale).to(DQ.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


@triton.jit
def _z(sd, vis, lse, delta, scale, scale_log2, R: tl.constexpr, BK: tl.constexpr):
    """(s, dp) rows [2R,BK] (X k^T) -> Z [2R,BK] interleaved like X: Z[2i] = scale ds_i, Z[2i+1] = p_i, so that
    Z^T X = p^T dO + scale ds^T q. vis [R,BK]: the attending pairs."""
    s, dp = _split(sd, R, BK)                                                           # [R,BK] each
    p = tl.where(vis, tl.exp2(s * scale_log2 - lse[:, None]), 0.0)
    ds = p * (dp - delta[:, None]) * scale
    return tl.reshape(tl.permute(tl.join(ds, p), (0, 2, 1)), [2 * R, BK])


@triton.jit
def _dkv_step(x, k, vis, lse, delta, acc, scale, scale_log2, R: tl.constexpr, BK: tl.constexpr,
              PREC: tl.constexpr):
    """Keys k [BK,BD] against one row tile X [2R,BD] (_rows): acc [BK,BD] += p^T dO + scale ds^T q as ONE dot
    Z^T X (_z). vis [R,BK]: attending pairs."""
    z = _z(tl.dot(x, tl.trans(k), input_precision=PREC), vis, lse, delta, scale, scale_log2, R, BK)
    return tl.dot(tl.trans(z.to(k.dtype)), x, acc, input_precision=PREC)


@triton.jit
def _bwd_dkv(Q, DO, LSE, DELTA, KEYS, DKEYS, WORDS, LIST, OFFS,
             sq_b, sq_s, sq_h, sk_b, sk_s, sw_b, sw_s, sl_b, sl_k, so_b, so_k,
             S, H, D, W, n_keys, n_blocks, qchunk, scale, scale_log2,
             WINDOW: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    """Key-major: a program owns keys [kb*BK, kb*BK + BK) of KEYS[b] and one chunk of the queries that see
    them; it loops over (query, head tile) rows and writes / adds the [BK, D] gradient once.
    WINDOW: grid (chunk, b * n_blocks + kb), chunk c = queries [j0 + c*qchunk, ...) of [j0, j0 + BK + W - 1).
    Else:   grid (b * n_blocks + kb, chunk), chunk c = the block's selecting queries in [c*qchunk, (c+1)*qchunk):
            LIST[b, kb, OFFS[b, kb, c] : OFFS[b, kb, c+1]] (selection_lists).
    Programs launched together read the same queries either way (neighbouring blocks / one query range)."""
    if WINDOW:
        chunk, pid = tl.program_id(0), tl.program_id(1).to(tl.int64)
    else:
        pid, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b, kb = pid // n_blocks, pid % n_blocks
    offs_k, offs_r, offs_d = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_D)
    offs_x = tl.arange(0, 2 * BLOCK_R)
    keys = kb * BLOCK_K + offs_k
    mask_k, mask_d = keys < n_keys, offs_d < D
    koff = b * sk_b + keys[:, None] * sk_s + offs_d[None, :]
    k = tl.load(KEYS + koff, mask=mask_k[:, None] & mask_d[None, :], other=0.0)       # [BK,BD]
    if WINDOW:
        lo = kb * BLOCK_K + chunk * qchunk
        hi = tl.minimum(tl.minimum(lo + qchunk, kb * BLOCK_K + BLOCK_K + W - 1), S)
    else:
        lo = tl.load(OFFS + b * so_b + kb * so_k + chunk)
        hi = tl.load(OFFS + b * so_b + kb * so_k + chunk + 1)
    n_ht = tl.cdiv(H, BLOCK_R)
    acc = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    for it in range(0, tl.maximum(hi - lo, 0) * n_ht):
        i = lo + it // n_ht
        h0 = (it % n_ht) * BLOCK_R
        mask_r = h0 + offs_r < H
        if WINDOW:
            t = i.to(tl.int64)
            dist = t - keys
            vis = (dist >= 0) & (dist < W) & mask_k
        else:
            t = tl.load(LIST + b * sl_b + kb * sl_k + i).to(tl.int64)
            word = tl.load(WORDS + b * sw_b + t * sw_s + kb)
            vis = ((word >> offs_k.to(tl.int64)) & 1) != 0
        x = _rows(Q, DO, b * sq_b + t * sq_s, offs_x, h0, H, sq_h, offs_d, mask_d)      # [2BR,BD]
        lse = tl.load(LSE + (b * S + t) * H + h0 + offs_r, mask=mask_r, other=0.0)
        delta = tl.load(DELTA + (b * S + t) * H + h0 + offs_r, mask=mask_r, other=0.0)
        acc = _dkv_step(x, k, mask_r[:, None] & vis[None, :], lse, delta, acc, scale, scale_log2, BLOCK_R,
                        BLOCK_K, PREC)
    omask = mask_k[:, None] & mask_d[None, :]
    if ATOMIC:
        if hi > lo:   # empty chunks add nothing
            tl.atomic_add(DKEYS + koff, acc, mask=omask, sem="relaxed")
    else:
        tl.store(DKEYS + koff, acc.to(DKEYS.dtype.element_ty), mask=omask)


@triton.jit
def _bwd_dcomp_rows(Q, DO, LSE, DELTA, COMP, SEL, NSEL, DCOMP,
                    sq_b, sq_s, sq_h, sc_b, sc_c, ss_b, ss_s, sn_b,
                    S, H, D, scale, scale_log2,
                    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    """Query-major entries: program (query, head block) walks its selected entries in blocks of BLOCK_K and
    adds each block's [BK, D] tile to DCOMP (fp32) with atomics. The head dim is held as two halves (separate
    tiles) so the fp32 tile is converted for the atomic add half at a time: a whole [64, 512] tile's layout
    conversion needs 128 KB of shared memory on top of the 128 KB (q, dO) rows."""
    HD: tl.constexpr = BLOCK_D // 2
    pid = tl.program_id(0).to(tl.int64)
    b, t = pid // S, pid % S
    h0 = tl.program_id(1) * BLOCK_H
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_k, offs_lo, offs_x = tl.arange(0, BLOCK_K), tl.arange(0, HD), tl.arange(0, 2 * BLOCK_H)
    offs_hi = HD + offs_lo
    mask_h, mask_lo, mask_hi = offs_h < H, offs_lo < D, offs_hi < D
    base = b * sq_b + t * sq_s
    x_lo = _rows(Q, DO, base, offs_x, h0, H, sq_h, offs_lo, mask_lo)                    # [2BH,BD/2]
    x_hi = _rows(Q, DO, base, offs_x, h0, H, sq_h, offs_hi, mask_hi)
    lse = tl.load(LSE + pid * H + offs_h, mask=mask_h, other=0.0)
    delta = tl.load(DELTA + pid * H + offs_h, mask=mask_h, other=0.0)
    n_sel = tl.load(NSEL + b * sn_b + t)
    for start in range(0, n_sel, BLOCK_K):
        valid = start + offs_k < n_sel
        j = tl.load(SEL + b * ss_b + t * ss_s + start + offs_k, mask=valid, other=0).to(tl.int64)
        row = COMP + b * sc_b + j[:, None] * sc_c
        m_lo, m_hi = valid[:, None] & mask_lo[None, :], valid[:, None] & mask_hi[None, :]
        k_lo = tl.load(row + offs_lo[None, :], mask=m_lo, other=0.0)                   # [BK,BD/2]
        k_hi = tl.load(row + offs_hi[None, :], mask=m_hi, other=0.0)
        sd = tl.dot(x_hi, tl.trans(k_hi), tl.dot(x_lo, tl.trans(k_lo), input_precision=PREC), input_precision=PREC)
        z = _z(sd, mask_h[:, None] & valid[None, :], lse, delta, scale, scale_log2, BLOCK_H, BLOCK_K).to(k_lo.dtype)
        drow = DCOMP + b * sc_b + j[:, None] * sc_c
        tl.atomic_add(drow + offs_lo[None, :], tl.dot(tl.trans(z), x_lo, input_precision=PREC), mask=m_lo,
                      sem="relaxed")
        tl.atomic_add(drow + offs_hi[None, :], tl.dot(tl.trans(z), x_hi, input_precision=PREC), mask=m_hi,
                      sem="relaxed")


def selection_lists(sel, n_sel, n_entries: int, block: int, chunk: int):
    """The key-major entry pass's view of the selection, built with a few torch ops (no host sync):
    words [B',S,NB] int64   bit i of words[b,t,kb] = query t selected entry kb*block + i
    lists [B',NB,S] int32   per entry block, the queries that selected any of its entries, ascending (S-padded)
    offs  [B',NB,NC+1] int32  lists[b,kb,offs[c]:offs[c+1]] are those in [c*chunk, (c+1)*chunk)
    sel [B'|1,S,K] int32, entries < n_entries, each at most once per query; n_sel [B',S]: its valid prefix."""
    Bs, S, K = sel.shape
    nb = triton.cdiv(n_entries, block)
    valid = torch.arange(K, device=sel.device)[None, None] < n_sel[..., None]
    s = torch.where(valid, sel, 0).long()
    blk = torch.where(valid, s // block, nb)                                            # nb: a spare column
    bit = torch.where(valid, torch.ones_like(s) << (s % block), 0)
    words = torch.zeros(Bs, S, nb + 1, dtype=torch.int64, device=sel.device)
    words.scatter_add_(2, blk, bit)                                                     # distinct bits: sum = OR
    words = words[..., :nb].contiguous()
    t = torch.arange(S, device=sel.device, dtype=torch.int32)
    lists = torch.where((words != 0).transpose(1, 2), t, S).sort(-1).values.contiguous()   # [B',NB,S]
    edges = (torch.arange(0, triton.cdiv(S, chunk) + 1, device=sel.device, dtype=torch.int32) * chunk).clamp_max(S)
    offs = torch.searchsorted(lists, edges.expand(Bs, nb, -1).contiguous()).to(torch.int32)
    return words, lists, offs


def _chunk(n_blocks: int, rows: int, programs: int, min_chunk: int) -> int:
    """Queries per program: split each block's `rows` queries so that about `programs` programs run, but no
    chunk smaller than min_chunk (each chunk re-reads its keys and adds its tile once)."""
    chunks = max(1, min(triton.cdiv(programs, max(n_blocks, 1)), triton.cdiv(rows, min_chunk)))
    return triton.cdiv(rows, chunks)


def comp_mode(cfg: dict, sel, n_entries: int) -> str:
    """"keys" (key-major entry pass) or "rows" (query-major with atomics). "auto": keys when a query's kept
    entries are a large share of the entries it sees, K >= keys_min_fill x C/2 (on average a query sees half
    of the C entries): C128's all-visible lists always; C4 (K = 512, C = S/4) up to S = 4096 / keys_min_fill."""
    mode = cfg.get("comp_mode", "auto")
    if mode not in ("auto", "keys", "rows"):
        raise ValueError(f"attention backward: comp_mode must be auto, keys or rows, got {mode!r}")
    if mode != "auto":
        return mode
    return "keys" if sel.shape[-1] >= cfg.get("keys_min_fill", 1.0) * n_entries / 2 else "rows"


def _kcfg(cfg: dict) -> dict:
    """Launch keywords of a pass config (its BLOCK_* sizes and num_warps / num_stages)."""
    return {k: v for k, v in cfg.items() if k.startswith("BLOCK_") or k in ("num_warps", "num_stages")}


def attention_backward_wgmma(do, q, kv, comp, sel, n_sel, o, lse, scale: float, window: int, cfg: dict):
    """The passes of the module docstring. -> dq, dkv, dcomp (or None), delta [B,S,H]
    cfg: dq=dict(BLOCK_H, BLOCK_K, num_warps, num_stages[, fuse_delta]), dkv=dict(BLOCK_K, BLOCK_R, num_warps,
    num_stages, programs, min_chunk), comp=dict(BLOCK_K, BLOCK_R, num_warps, num_stages, chunk, comp_mode,
    keys_min_fill, rows=dict(BLOCK_H, BLOCK_K, num_warps, num_stages))."""
    q, do, o = (t.contiguous() for t in (q, do, o))   # _bwd_delta and _rows index q, dO, o alike
    B, S, H, D = q.shape
    prec = tgt.dot_precision(q.dtype, tgt.device_target(q.device))
    BD = max(MIN_DOT, triton.next_power_of_2(D))
    scale_log2 = scale * 1.4426950408889634
    delta = torch.empty(B, S, H, device=q.device, dtype=torch.float32)
    fuse = cfg["dq"].get("fuse_delta", False)
    if not fuse:
        _bwd_delta[(triton.cdiv(B * S * H, DELTA_ROWS),)](o, do, delta, B * S * H, D, BLOCK_R=DELTA_ROWS, BLOCK_D=BD)
    # the dq pass runs first: with fuse_delta it writes delta, which every later pass reads
    dq = _dq_pass(do, q, kv, comp, sel, n_sel, lse, delta, scale, scale_log2, window, prec, BD, cfg["dq"], o)
    dkv = _key_major(q, do, lse, delta, kv, None, scale, scale_log2, window, prec, BD, cfg["dkv"])
    dcomp = None
    if comp is not None and comp_mode(cfg["comp"], sel, comp.shape[1]) == "keys":
        dcomp = _key_major(q, do, lse, delta, comp, (sel, n_sel), scale, scale_log2, window, prec, BD, cfg["comp"])
    elif comp is not None:
        dcomp = _rows_comp(q, do, lse, delta, comp, sel, n_sel, scale, scale_log2, prec, BD, cfg["comp"]["rows"])
    return dq, dkv, dcomp, delta


def _dq_pass(do, q, kv, comp, sel, n_sel, lse, delta, scale, scale_log2, window, prec, BD, qc, o=None):
    """Launch `_bwd_dq`; with qc["fuse_delta"] it also writes delta from o (contiguous, as q). -> dq in q's dtype"""
    fuse = qc.get("fuse_delta", False)
    if fuse and o is None:
        raise ValueError("attention backward: the dq pass needs o to compute delta (fuse_delta=True)")
    B, S, H, D = q.shape
    bh = max(MIN_DOT, min(qc["BLOCK_H"], triton.next_power_of_2(H)))
    cs = (comp.stride(0), comp.stride(1)) if comp is not None else (0, 0)
    ss = (sel.stride(0) if sel.shape[0] > 1 else 0, sel.stride(1)) if sel is not None else (0, 0)
    ns = (n_sel.stride(0) if n_sel.shape[0] > 1 else 0,) if n_sel is not None else (0,)
    dq = torch.empty_like(q)
    _bwd_dq[(B * S, triton.cdiv(H, bh))](
        q, kv, comp if comp is not None else kv, sel if sel is not None else kv, n_sel if n_sel is not None else kv,
        do, o if fuse else do, lse, delta, dq, q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
        *cs, *ss, *ns,
        S, H, D, window, scale, scale_log2, HAS_COMP=comp is not None, FUSE_DELTA=fuse, DELTA_COLS=DELTA_COLS,
        PREC=prec, **dict(_kcfg(qc), BLOCK_H=bh, BLOCK_D=BD))
    return dq


def _key_major(q, do, lse, delta, keys, selection, scale, scale_log2, window, prec, BD, kc):
    """Launch `_bwd_dkv` over the rows of `keys` [B,N,D]: the window rule (selection None) or a selection
    (sel, n_sel). -> the gradient of keys, in keys' dtype"""
    B, S, H, D = q.shape
    N = keys.shape[1]
    bk = kc["BLOCK_K"]
    br = max(MIN_DOT, min(kc["BLOCK_R"], triton.next_power_of_2(H)))
    nb = triton.cdiv(N, bk)
    if selection is None:
        rows = min(S, bk + window - 1)
        qchunk = _chunk(B * nb, rows, kc.get("programs", 264), kc.get("min_chunk", 32))
        chunks = triton.cdiv(rows, qchunk)
        words = lists = offs = keys                                                     # never read
        strides = (0,) * 6
        grid = (chunks, B * nb)
    else:
        if bk > WORD_BITS:
            raise ValueError(f"attention backward: the entry pass's BLOCK_K={bk} must be <= {WORD_BITS}")
        qchunk = kc.get("chunk", 64)
        words, lists, offs = selection_lists(*selection, N, bk, qchunk)
        chunks = offs.shape[-1] - 1
        bs = words.shape[0] > 1
        strides = (words.stride(0) if bs else 0, words.stride(1), lists.stride(0) if bs else 0, lists.stride(1),
                   offs.stride(0) if bs else 0, offs.stride(1))
        grid = (B * nb, chunks)
    atomic = chunks > 1
    out = torch.zeros(keys.shape, device=keys.device, dtype=torch.float32) if atomic else torch.empty_like(keys)
    _bwd_dkv[grid](q, do, lse, delta, keys, out, words, lists, offs,
                   q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), *strides,
                   S, H, D, window, N, nb, qchunk, scale, scale_log2, WINDOW=selection is None, ATOMIC=atomic,
                   PREC=prec, **dict(_kcfg(kc), BLOCK_K=bk, BLOCK_R=br, BLOCK_D=BD))
    return out.to(keys.dtype)


def _rows_comp(q, do, lse, delta, comp, sel, n_sel, scale, scale_log2, prec, BD, rc):
    """Launch `_bwd_dcomp_rows`. -> dcomp in comp's dtype"""
    B, S, H, D = q.shape
    bh = max(MIN_DOT, min(rc["BLOCK_H"], triton.next_power_of_2(H)))
    dcomp = torch.zeros(comp.shape, device=comp.device, dtype=torch.float32)
    _bwd_dcomp_rows[(B * S, triton.cdiv(H, bh))](
        q, do, lse, delta, comp, sel, n_sel, dcomp, q.stride(0), q.stride(1), q.stride(2),
        comp.stride(0), comp.stride(1), sel.stride(0) if sel.shape[0] > 1 else 0, sel.stride(1),
        n_sel.stride(0) if n_sel.shape[0] > 1 else 0, S, H, D, scale, scale_log2, PREC=prec,
        **dict(_kcfg(rc), BLOCK_H=bh, BLOCK_D=BD))
    return dcomp.to(comp.dtype)
