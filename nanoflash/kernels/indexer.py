"""The lightning indexer's selection without an [S, heads, C] tensor and without a full sort.

`model.Indexer` (the reference) scores every (query, head, entry) into a [B,S,HI,C] fp32 tensor, sums the
heads and stable-sorts all C entries of every query. Here:

    score[t, u] = sum_h relu(qI[t,h] . KI[u]) * w[t,h]     for u < (start_pos + t + 1) // 4, else -inf

is one Triton program per query (`_scores`): qI [HI, dI] times a block of entries on the tensor cores (fp32
accumulation; exact fp32 dots for fp32 inputs), ReLU and the weighted head sum in registers, only the [C]
row written. The top-k then runs on that [B,S,C] row (`topk_lower_index_wins`): each score is mapped to an
int32 whose order is the float order (-0.0 folded onto +0.0, so ReLU zeros tie as in the reference), packed
with (C-1-u) into one int64, and `torch.topk` picks the k largest -- equal scores go to the lower entry
index, the stable sort's tie-break, so prefill and decode (the reference) keep the same entries.

Shapes: q [B,S,HI,dI], keys [B,C,dI], w [B,S,HI] fp32 -> sel [B,S,k] int32 (entries, -1 = none)

Tests: `pytest tests/test_kernels_attention.py` (interpreter) and `tests/test_kernels_attention_gpu.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoflash.kernels import target as tgt

SCORE_CONFIG = dict(BLOCK_C=64, num_warps=4, num_stages=2)
AMD_SCORE_CONFIG = dict(BLOCK_C=64, num_warps=4, num_stages=2)   # no scratch on gfx942 / gfx950 (compile test)
TOPK_CHUNK = 2048   # queries per top-k call: bounds the int64 key tensor to TOPK_CHUNK x C x 8 bytes


@triton.jit
def _scores(Q, K, Wt, OUT, sq_b, sq_s, sq_h, sk_b, sk_c, sw_b, sw_s, so_b, so_s,
            S, C, HI, DI, start_pos, RATIO: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
            BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b, t = pid // S, pid % S
    offs_h, offs_c, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_D)
    mask_h, mask_d = offs_h < HI, offs_d < DI
    q = tl.load(Q + b * sq_b + t * sq_s + offs_h[:, None] * sq_h + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)                     # [BH,BD]
    w = tl.load(Wt + b * sw_b + t * sw_s + offs_h, mask=mask_h, other=0.0)             # [BH] fp32
    n_vis = tl.minimum((start_pos + t + 1) // RATIO, C)
    for c0 in range(0, n_vis, BLOCK_C):
        cols = c0 + offs_c
        valid = cols < n_vis
        k = tl.load(K + b * sk_b + cols.to(tl.int64)[:, None] * sk_c + offs_d[None, :],
                    mask=valid[:, None] & mask_d[None, :], other=0.0)                  # [BC,BD]
        s = tl.dot(q, tl.trans(k), input_precision=PREC)                               # [BH,BC]
        score = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)                             # [BC]
        tl.store(OUT + b * so_b + t * so_s + cols, score, mask=valid)


def index_scores(q, keys, w, start_pos: int = 0, ratio: int = 4, config=None) -> torch.Tensor:
    """score[b,t,u] (see the module docstring); -inf where entry u is not yet visible. -> [B,S,C] fp32"""
    B, S, HI, DI = q.shape
    if keys.dim() != 3 or keys.shape[0] != B or keys.shape[2] != DI or w.shape != (B, S, HI):
        raise ValueError(f"index_scores: q [B,S,HI,dI], keys [B,C,dI], w [B,S,HI] expected, got q "
                         f"{tuple(q.shape)}, keys {tuple(keys.shape)}, w {tuple(w.shape)}")
    if q.dtype != keys.dtype:
        raise ValueError(f"index_scores: q and keys need one dtype, got {q.dtype} and {keys.dtype}")
    C = keys.shape[1]
    q, keys, w = q.contiguous(), keys.contiguous(), w.float().contiguous()
    out = torch.full((B, S, C), float("-inf"), device=q.device, dtype=torch.float32)
    if C == 0 or S == 0:
        return out
    target = tgt.device_target(q.device)
    cfg = dict(config or (AMD_SCORE_CONFIG if tgt.is_amd(target) else SCORE_CONFIG))
    cfg["BLOCK_C"] = max(16, min(cfg["BLOCK_C"], triton.next_power_of_2(C)))
    prec = tgt.dot_precision(q.dtype, target)
    _scores[(B * S,)](q, keys, w, out, q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1),
                      w.stride(0), w.stride(1), out.stride(0), out.stride(1), S, C, HI, DI, start_pos,
                      RATIO=ratio, BLOCK_H=max(16, triton.next_power_of_2(HI)),
                      BLOCK_D=max(16, triton.next_power_of_2(DI)), PREC=prec, **cfg)
    return out


def _ordered_int(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> int32 with the same order (-0.0 and +0.0 map to one value, -inf to the smallest)."""
    bits = (x + 0.0).view(torch.int32)                      # x + 0.0 turns -0.0 into +0.0
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)   # negative floats: larger magnitude -> smaller int


def topk_lower_index_wins(score: torch.Tensor, k: int) -> torch.Tensor:
    """The k highest entries of each row, ties to the lower index; -inf entries become -1 (sorted to the end).
    score [B,S,C] fp32 -> [B,S,k] int32, best first"""
    C = score.shape[-1]
    k = min(k, C)
    low = (C - 1 - torch.arange(C, device=score.device)).to(torch.int64)             # lower u -> larger key
    out = []
    for a in range(0, score.shape[1], TOPK_CHUNK):
        s = score[:, a:a + TOPK_CHUNK]
        key = _ordered_int(s).to(torch.int64) * (1 << 32) + low                       # [B,s,C]
        top = key.topk(k, dim=-1, sorted=True).indices                                 # [B,s,k]
        out.append(torch.where(s.gather(-1, top) > float("-inf"), top, -1).to(torch.int32))
    return torch.cat(out, 1) if out else score.new_zeros(*score.shape[:2], k, dtype=torch.int32)


def indexer_topk(q, keys, w, start_pos: int, topk: int) -> torch.Tensor:
    """The indexer's selection as an index list: scores (`index_scores`) then `topk_lower_index_wins`.
    q [B,S,HI,dI], keys [B,C,dI], w [B,S,HI] -> [B,S,min(topk,C)] int32, -1 = none"""
    with torch.no_grad():
        return topk_lower_index_wins(index_scores(q, keys, w, start_pos), topk)
