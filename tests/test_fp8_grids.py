"""FP8 128x128 scale grids on multi-block, non-square tensors whose per-block amax is known by construction.

A tensor that fits in one 128x128 block has a 1x1 scale grid, so a transposed, tiled or mis-sliced grid
cannot show; and a round-trip bound written with the *stored* scale grows with an oversized scale, so it
cannot catch one. Here every block (i, j) of a weight gets its own amax A[i,j] (one element set to +-A[i,j],
the rest below it, spread over 2^-24..1 of it so e4m3's subnormal range is populated), and all checks use
A, never the stored scale:

    fp32 scale (Miles, the push):  S[i,j] = A[i,j] / 448                    exactly, at position [i, j]
    ue8m0 scale (the release):     S[i,j] = 2^ceil(log2(A[i,j] / 448))      exactly
    the block's amax element lands on max |Q| = A / S  (448 for fp32 scales)
    |dequant(Q, S) - W| <= max(|W| 2^-4, S_A 2^-10)  with S_A the scale computed from A

and through the push: the trainer's multi-block weights -> `iter_sglang_buckets(fp8=True)` -> the embedded
engine's loader (fused wqkv_a / w13 halves with their own scale rows) -> dequantized parameters, equal bit
for bit to a naive per-block loop on the original weights.
Bugs these catch (each planted once): scale rows tiled instead of interleaved, a grid sliced at the wrong row
when a fused pair is split, an oversized (or undersized) scale.
Run: `pytest tests/test_fp8_grids.py -q`.
"""
import math

import pytest
import torch

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.quant import dequantize_fp8_block, e8m0_decode, quantize_fp8_block
from nanoflash.server.engine import RolloutEngine
from nanoflash.sglang.layout import from_sglang, sglang_fp8
from nanoflash.sglang.transports import iter_sglang_buckets

BLOCK, E4M3_MAX = 128, 448.0
E4M3_HALF_ULP_REL = 2.0 ** -4    # 3 mantissa bits: rounding error <= |x| 2^-4 in the normal range
E4M3_SUBNORMAL_ABS = 2.0 ** -10  # below 2^-6 the e4m3 grid step is 2^-9: error <= 2^-10 in units of the scale
SHAPE = (300, 520)               # grid 3 x 5, the last row and column of blocks partial (44 rows, 8 columns)
# A multi-block tiny model: dim 320 and q_lora_rank / moe_inter_dim 200 give grids of 2x3, 3x2, 1x3, 1x2,
# and fused pairs whose first half ends inside a block (200 rows = 1 full + 1 partial block of scales).
BIG_TINY = dict(dim=320, q_lora_rank=200, moe_inter_dim=200, n_layers=2, n_hash_layers=1, compress_ratios=(0, 4, 0))


def grid(shape):
    return -(-shape[0] // BLOCK), -(-shape[1] // BLOCK)


def planted_weight(shape, gen):
    """W with block amax A[i,j] = 1.375 * 2^(e_ij), e_ij distinct (-9..5), the amax element at a random spot."""
    rb, cb = grid(shape)
    amax = 1.375 * 2.0 ** (torch.randperm(rb * cb, generator=gen).view(rb, cb).double() - 9)   # [rb,cb]
    mag = 2.0 ** (-24 * torch.rand(shape, generator=gen, dtype=torch.float64))                  # (2^-24, 1]
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
    w = torch.empty(shape, dtype=torch.float64)
    for i in range(rb):
        for j in range(cb):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            blk = (mag[rows, cols] * 0.999).mul(sign[rows, cols]) * amax[i, j]
            r = int(torch.randint(0, blk.shape[0], (1,), generator=gen))
            c = int(torch.randint(0, blk.shape[1], (1,), generator=gen))
            blk[r, c] = amax[i, j] * (1 if (i + j) % 2 else -1)
            w[rows, cols] = blk
    return w.float(), amax.float()


def per_element(s, shape):
    """Grid [rb,cb] -> [M,N] by a plain loop over blocks (independent of quant._expand_2d)."""
    out = torch.empty(shape, dtype=s.dtype)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = s[i, j]
    return out


def known_scale(amax, fmt):
    if fmt == "fp32":
        return amax / E4M3_MAX                                     # the same fp32 division as the quantizer
    return torch.tensor([[2.0 ** math.ceil(math.log2(float(a) / E4M3_MAX)) for a in row] for row in amax])


@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
def test_scale_grid_is_the_known_block_amax(fmt, gen):
    w, amax = planted_weight(SHAPE, gen)
    q, s = quantize_fp8_block(w, fmt=fmt)
    s = s.float() if fmt == "fp32" else e8m0_decode(s)
    want = known_scale(amax, fmt)
    assert s.shape == want.shape == (3, 5), f"grid {tuple(s.shape)}"
    assert torch.equal(s, want), f"scale grid\n{s}\n!= known amax / 448\n{want}"
    qa = q.float().abs()
    for i, j in [(i, j) for i in range(3) for j in range(5)]:
        top = qa[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].max().item()
        assert top == (E4M3_MAX if fmt == "fp32" else float(amax[i, j] / want[i, j])), f"block {i},{j}: max|Q| {top}"


@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
def test_round_trip_bounded_by_the_known_scale(fmt, gen):
    w, amax = planted_weight(SHAPE, gen)
    deq = dequantize_fp8_block(*quantize_fp8_block(w, fmt=fmt), torch.float32)
    s_known = per_element(known_scale(amax, fmt), SHAPE)
    bound = torch.maximum(w.abs() * E4M3_HALF_ULP_REL, s_known * E4M3_SUBNORMAL_ABS)
    err = (deq - w).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3e}"
    assert (w.abs() < s_known * 2.0 ** -6).sum() > 1000, "self-check: the subnormal range is exercised"


def test_dequantize_reads_each_block_its_own_scale(gen):
    """Scales chosen independently of Q: dequantize must multiply block (i, j) by S[i, j]."""
    q = (torch.randn(SHAPE, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = 2.0 ** torch.randperm(15, generator=gen).view(3, 5).float()
    assert torch.equal(dequantize_fp8_block(q, s, torch.float32), q.float() * per_element(s, SHAPE))


# ---------------------------------------------------------------------------------------------- the push
def naive_fp8_round_trip(w):
    """Miles' per-block loop: S = max(amax, 1e-10)/448, Q = e4m3(clamp(W * (1/S))), back: Q * S."""
    out = torch.empty_like(w, dtype=torch.float32)
    for i in range(0, w.shape[0], BLOCK):
        for j in range(0, w.shape[1], BLOCK):
            blk = w[i:i + BLOCK, j:j + BLOCK].float()
            sc = torch.clamp(blk.abs().max(), min=1e-10) / E4M3_MAX
            q = (blk * (1.0 / sc)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            out[i:i + BLOCK, j:j + BLOCK] = q.float() * sc
    return out


@pytest.fixture(scope="module")
def big_tiny():
    """A tiny-shaped model whose FP8 weights span several blocks each way, each block scaled differently."""
    model = Transformer(preset("tiny", **BIG_TINY)).init_weights(0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():   # official names (state_dict): per-expert views even if experts are stored stacked
        for name, p in model.state_dict(keep_vars=True).items():
            if p.dim() == 2 and sglang_fp8(name, model.cfg):
                factor = 2.0 ** torch.randint(-6, 7, grid(p.shape), generator=g).float()   # [rb,cb]
                p.mul_(per_element(factor, p.shape))
    return model


def test_pushed_scale_grids_are_the_block_amax(big_tiny):
    sent = {n: t for bucket in iter_sglang_buckets(big_tiny, fp8=True, bucket_bytes=1 << 40) for n, t in bucket}
    params = big_tiny.state_dict()
    fp8 = [n for n, t in sent.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) > 20
    multi = 0
    for n in fp8:
        w = params[from_sglang(n)].detach()
        rb, cb = grid(w.shape)
        multi += rb > 1 and cb > 1
        amax = torch.stack([torch.stack([w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].abs().max()
                                         for j in range(cb)]) for i in range(rb)])
        assert torch.equal(sent[n + "_scale_inv"], amax.clamp_min(1e-10) / E4M3_MAX), n
    assert multi >= 4, "self-check: several pushed weights have multi-block grids in both directions"


def test_engine_dequantizes_pushed_grids_like_the_naive_loop(big_tiny):
    """Fused halves (wqkv_a, w13, shared gate_up) carry their own scale rows; the derived weights must equal
    the naive per-block round trip of the trainer's weights exactly."""
    want = {n: naive_fp8_round_trip(p) for n, p in big_tiny.state_dict().items()
            if p.dim() == 2 and sglang_fp8(n, big_tiny.cfg) and not n.startswith("mtp.")}   # MTP is not pushed
    original = {n: p.clone() for n, p in big_tiny.state_dict().items()}
    engine = RolloutEngine(big_tiny, weights="fp8", decode="full")   # derives the model's weights in place
    try:
        got = engine.model.state_dict()
        for n, w in want.items():
            same = torch.equal(got[n].detach(), w)
            assert same, f"{n}: max |diff| {(got[n].detach() - w).abs().max().item():.3e}"
        assert not torch.equal(got["layers.0.attn.wq_a.weight"], original["layers.0.attn.wq_a.weight"]), \
            "self-check: the engine really runs on FP8-rounded weights"
    finally:
        with torch.no_grad():                                           # leave the module fixture as it was
            for n, p in big_tiny.state_dict(keep_vars=True).items():
                p.copy_(original[n])
