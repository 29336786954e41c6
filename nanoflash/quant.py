"""Low-precision number formats of DeepSeek-V4-Flash, in plain PyTorch (CPU or GPU), plus one GPU kernel.

What is here, and who uses it:

* **E8M0 scales** (`e8m0_encode` / `e8m0_decode`): one byte b stands for 2^(b-127); b = 255 is NaN. Every
  scale in the official checkpoint is one of these (`<name>.scale`, dtype F8_E8M0).
* **FP8 weights, 128x128 blocks** (`quantize_fp8_block` / `dequantize_fp8_block`):
  W[i,j] ~= float(Q[i,j]) * S[i//128, j//128], Q in e4m3 (max 448). Two scale conventions:
    - ``fmt="ue8m0"``: S = 2^ceil(log2(amax/448)), stored as float8_e8m0fnu (the official checkpoint);
    - ``fmt="fp32"``: S = max(amax, 1e-10)/448 in fp32 and Q = e4m3(clamp(W * (1/S), +-448)); this is what
      Miles/slime send to SGLang on Hopper as ``weight_scale_inv`` (their `blockwise_cast_to_fp8_triton`).
* **The weight stream's quantizer** (`quantize_fp8_block_into`): the ``fmt="fp32"`` convention written into
  preallocated buffers, bit for bit; on CUDA one Triton kernel (one program per 128x128 block: amax, IEEE
  `div_rn` for S and 1/S, clamp, RNE cast), elsewhere the reference on bounded slabs.
* **FP4 (MXFP4) routed experts** (`quantize_fp4` / `dequantize_fp4`): e2m1 values, two per int8 byte
  (element 2k = low nibble, 2k+1 = high nibble; nibble bit 3 = sign), one E8M0 scale per 1x32 block,
  S = 2^ceil(log2(amax/6)).
* **FP4 -> FP8 lossless repack** (`fp4_to_fp8`): official ``convert.py --expert-dtype fp8``. Per 128x128 tile
  the new scale is max(S32)/2^6 and each value is multiplied by S32/new_scale, a power of two in
  (0, 2^6]; 6 * 2^6 = 384 < 448, and e2m1 values have 2 significant bits, so the product is exact
  whenever it does not fall below e4m3's subnormal grid (2^-9): i.e. every S32 in the tile is at least
  max(S32) * 2^-14. Real checkpoints sit far inside this; the test pins the boundary.
* **QAT simulations** (`fp8_sim`, `fp4_sim`): the official forward fake-quantizes some activations
  (kernel.py `act_quant(inplace=True)` and `fp4_act_quant(inplace=True)`): per contiguous block of the last dim
      s = 2^ceil(log2(max(amax, floor) * (1/qmax))),   x <- round_to_grid(clamp(x/s, +-qmax)) * s
  with (qmax, floor) = (448, 1e-4) for FP8 e4m3 and (6, 6*2^-126) for FP4 e2m1. The backward pass is the
  straight-through estimator (gradient = identity), which is what QAT training uses.
* **Walsh-Hadamard rotation** (`hadamard`): Sylvester order, scale dim^-0.5, as `fast_hadamard_transform`.
* **SGLang's FP8 indexer operands** (`fp8_index_sim`): SGLang 0.5.16 on Hopper scores the C4 lightning indexer
  in FP8 (DeepGEMM `fp8_paged_mqa_logits`), not the official FP4 QAT: q per (token, head) and each indexer key
  per entry, Hadamard-rotated, then one FP8 e4m3 row of 128 with an fp32 (not power-of-two) scale
      s = max(amax, 1e-4) / 448,   x <- e4m3(clamp(x * (1/s), +-448)) * s
  (`ModelConfig.indexer_quant="fp8"`; the sources are cited at the function).

Rounding rules: e4m3 casts are torch's round-to-nearest-even (saturating); e2m1 rounding is
round-to-nearest with ties to the even code (mantissa bit 0), i.e. IEEE RNE, as the hardware `cvt.rn`:
0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. Power-of-two scales use
ceil(log2(amax * fp32(1/qmax))), computed exactly with `frexp` (the official kernel does the same with
IEEE bit tricks). The ue8m0 *weight* amax floor is our choice: 448 * 2^-126, so an all-zero block gets the
smallest normal fp32 scale 2^-126 and no real block is ever altered (a 1e-4 floor, as for activations,
would flatten genuinely small weight blocks).

Non-finite inputs: a NaN or +-inf anywhere in a block poisons exactly that block. Its scale becomes NaN
(e8m0 byte 255, or fp32 NaN/inf) and it dequantizes to all-NaN; other blocks are unaffected. The QAT sims
return NaN for every element of such a block. Quantized payload bytes of a poisoned block are unspecified.

How this differs from production: the official code and SGLang use fused GPU kernels (tilelang, Triton,
DeepGEMM) and never materialise the dequantized weight; here everything but the stream's quantizer is
explicit fp32 tensor math.
Bit-exactness vs Miles' Triton kernel holds up to its division: Triton's default fp32 `/` is the
approximate `div.full.f32`, so on GPU amax/448 and 1/scale may differ from IEEE by an ulp; here they are
IEEE-correct. DeepGEMM's packed-UE8M0 (Blackwell) scale layout is not produced.

Tests: ``pytest tests/test_quant.py -q``
"""
import functools
import math

import torch

from nanoflash.names import FP4_BLOCK, FP8_BLOCK  # noqa: F401  (defined once: 128x128 and 1x32)

ACT_QAT_BLOCK = 128    # official 1x128 activation quantization before FP8 / FP4 GEMMs


def qat_block(n: int, block: int) -> int:
    """The official QAT block, or the largest divisor of it that tiles a (test-sized) dim n."""
    return block if n % block == 0 else math.gcd(n, block)

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0  # largest FP4 e2m1 value
# nibble -> value; bit 3 is the sign (codes 8..15 are the negatives of 0..7, 8 is -0)
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)

FP8_ACT_AMAX_FLOOR = 1e-4  # official act_quant floor (kernel.py)
FP4_ACT_AMAX_FLOOR = 6.0 * 2.0**-126  # official fp4 floor: scale >= 2^-126, the smallest normal fp32
FP8_WEIGHT_AMAX_FLOOR = E4M3_MAX * 2.0**-126  # our ue8m0 weight floor: zero block -> scale 2^-126
MILES_AMAX_EPS = 1e-10  # Miles/slime `eps` in blockwise_cast_to_fp8_triton
FP4_TO_FP8_MAX_OFFSET_BITS = 6  # 6 * 2^6 = 384 <= 448 < 6 * 2^7 (convert.py MAX_OFFSET_BITS)

E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", torch.uint8)  # torch >= 2.7 has the real dtype
_E8M0_NAN = 255
# e2m1 magnitude (times 2) -> code 0..7; only entries 0,1,2,3,4,6,8,12 are ever looked up
_FP4_CODE_OF_2X = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)


# ---------------------------------------------------------------------------- E8M0 scales
def e8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scale -> E8M0 byte b = ceil(log2(scale)) + 127 (exact for powers of two).

    Non-powers of two round *up* (a scale that never shrinks can never overflow the quantized range).
    0 and anything below 2^-127 saturate to byte 0 (2^-127); negative, NaN, +inf and values above 2^127
    map to 255 (NaN). Returns float8_e8m0fnu where torch has it, else uint8. Shapes: any -> same.
    """
    s = scale.float()
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
    log2_ceil = torch.where(mant == 0.5, exp - 1, exp)
    b = (log2_ceil + 127).clamp(0, 255)
    b = torch.where(s == 0, torch.zeros_like(b), b)
    b = torch.where((s < 0) | ~torch.isfinite(s), torch.full_like(b, _E8M0_NAN), b)
    return b.to(torch.uint8).view(E8M0_DTYPE)


def e8m0_decode(t: torch.Tensor) -> torch.Tensor:
    """E8M0 (float8_e8m0fnu or raw uint8) -> fp32 2^(b-127), built bit by bit (exact; b=255 -> NaN)."""
    if t.dtype not in (torch.uint8, E8M0_DTYPE):
        raise TypeError(f"e8m0_decode expects float8_e8m0fnu or uint8, got {t.dtype}")
    b = t.view(torch.uint8).to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)  # b=0 is the fp32 subnormal 2^-127
    bits = torch.where(b == _E8M0_NAN, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """2^ceil(log2(amax * fp32(1/qmax))) in fp32, exact; non-finite amax stays non-finite (NaN)."""
    r = amax.float() * (1.0 / qmax)  # official: amax * fp8_max_inv (a Python scalar: fp32 against an fp32 tensor)
    mant, exp = torch.frexp(r)  # r = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp).clamp(-126, 127)  # floors and qmax >= 6 keep e in range
    s = ((e + 127) << 23).view(torch.float32)  # 2^e built from its IEEE bits: exact
    return torch.where(torch.isfinite(r), s, torch.full_like(r, float("nan")))


# ---------------------------------------------------------------------------- block helpers
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _blocks_2d(w: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """[M,N] -> zero-padded [M/bm, N/bn, bm, bn] view-copy (partial edge blocks padded with 0)."""
    m, n = w.shape
    pm, pn = _cdiv(m, bm) * bm - m, _cdiv(n, bn) * bn - n
    w = torch.nn.functional.pad(w, (0, pn, 0, pm))
    return w.view(_cdiv(m, bm), bm, _cdiv(n, bn), bn).transpose(1, 2)  # [Rb,Cb,bm,bn]


def _expand_2d(s: torch.Tensor, bm: int, bn: int, m: int, n: int) -> torch.Tensor:
    """Block grid [Rb,Cb] -> per element [m,n] (s[i//bm, j//bn])."""
    return s.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:m, :n]


def _check_2d(w: torch.Tensor, name: str) -> None:
    if w.ndim != 2:
        raise ValueError(f"{name} expects a 2-D weight [out, in], got shape {tuple(w.shape)}")


# ---------------------------------------------------------------------------- FP8 weights
def quantize_fp8_block(w: torch.Tensor, fmt: str = "ue8m0", block: int = FP8_BLOCK):
    """W [out,in] -> (Q float8_e4m3fn [out,in], S [ceil(out/128), ceil(in/128)]).

    fmt="ue8m0": S = 2^ceil(log2(max(amax, 448*2^-126)/448)) as float8_e8m0fnu; Q = e4m3(clamp(W/S, +-448)).
    fmt="fp32":  S = max(amax, 1e-10)/448 (fp32), Q = e4m3(clamp(W * (1/S), +-448))  (Miles weight_scale_inv).
    Either way W ~= Q * S per block.
    """
    _check_2d(w, "quantize_fp8_block")
    m, n = w.shape
    amax = _blocks_2d(w.float(), block, block).abs().amax(dim=(-1, -2))  # [Rb,Cb]
    if fmt == "ue8m0":
        s = _pow2_scale(amax.clamp_min(FP8_WEIGHT_AMAX_FLOOR), E4M3_MAX)
        q = w.float() / _expand_2d(s, block, block, m, n)
        out_scale = e8m0_encode(s)
    elif fmt == "fp32":
        # a tensor divisor: PyTorch's CUDA division by a CPU scalar multiplies by 1/b, not IEEE a/b (on an H200
        # the eager GPU bytes differed from the Triton kernel's, which equal the CPU reference's)
        s = amax.clamp_min(MILES_AMAX_EPS) / torch.full_like(amax, E4M3_MAX)
        q = w.float() * _expand_2d(1.0 / s, block, block, m, n)
        out_scale = s
    else:
        raise ValueError(f"quantize_fp8_block: fmt must be 'ue8m0' or 'fp32', got {fmt!r}")
    return q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), out_scale


QUANT_SLAB_BYTES = 16 << 20  # CPU path of quantize_fp8_block_into: fp32 bytes of one slab of 128-row blocks
QUANT_SCRATCH_FACTOR = 3     # its temporaries, in padded fp32 slabs (measured 2.0-2.5: the padded copy, |W|, W*(1/S))


def quant_scratch_bytes(shape, device="cpu") -> int:
    """Upper bound of the temporaries `quantize_fp8_block_into` allocates for a weight of `shape` (0 on CUDA)."""
    if torch.device(device).type == "cuda":
        return 0
    m, n = _cdiv(shape[0], FP8_BLOCK) * FP8_BLOCK, _cdiv(shape[1], FP8_BLOCK) * FP8_BLOCK
    rows = max(FP8_BLOCK, QUANT_SLAB_BYTES // (4 * max(shape[1], 1)) // FP8_BLOCK * FP8_BLOCK)
    return QUANT_SCRATCH_FACTOR * 4 * n * min(m, rows)


def quantize_fp8_block_into(w: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """`quantize_fp8_block(w, fmt="fp32")` written into preallocated Q e4m3 [m,n] and S fp32 [m/128, n/128],
    bit for bit (the weight stream fills its flattened buckets in place). CUDA: one Triton kernel
    (`_fp8_block_kernel`, IEEE division as the reference); CPU: the reference on slabs of 128-row blocks, so
    temporaries stay below ~4 x QUANT_SLAB_BYTES whatever the weight's size (block rows are independent)."""
    _check_2d(w, "quantize_fp8_block_into")
    m, n = w.shape
    want = (_cdiv(m, FP8_BLOCK), _cdiv(n, FP8_BLOCK))
    if tuple(q_out.shape) != (m, n) or tuple(s_out.shape) != want or q_out.dtype != torch.float8_e4m3fn \
            or s_out.dtype != torch.float32:
        raise ValueError(f"quantize_fp8_block_into: weight {(m, n)} needs Q e4m3 {(m, n)} and S fp32 {want}, "
                         f"got Q {q_out.dtype} {tuple(q_out.shape)}, S {s_out.dtype} {tuple(s_out.shape)}")
    if w.is_cuda:
        return _fp8_block_cuda(w, q_out, s_out)
    rows = max(FP8_BLOCK, QUANT_SLAB_BYTES // (4 * max(n, 1)) // FP8_BLOCK * FP8_BLOCK)
    for r in range(0, m, rows):
        q, s = quantize_fp8_block(w[r:r + rows], fmt="fp32")
        q_out[r:r + rows].copy_(q)
        s_out[r // FP8_BLOCK:r // FP8_BLOCK + s.shape[0]].copy_(s)


@functools.cache
def _fp8_block_kernel():
    """The Triton kernel (built on first use: CPU installs have no triton). One program per 128x128 block."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(w_ptr, q_ptr, s_ptr, M, N, stride_w, stride_q, n_cb, BLOCK: tl.constexpr):
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = (r[:, None] < M) & (c[None, :] < N)
        x = tl.load(w_ptr + r[:, None].to(tl.int64) * stride_w + c[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        poisoned = tl.sum(tl.sum((x != x).to(tl.int32), axis=1), axis=0) > 0   # tl.max drops NaN; torch keeps it
        amax = tl.where(poisoned, float("nan"), amax)
        s = tl.div_rn(tl.maximum(amax, 1e-10, propagate_nan=tl.PropagateNan.ALL), 448.0)
        q = x * tl.div_rn(1.0, s)
        q = tl.clamp(q, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + r[:, None].to(tl.int64) * stride_q + c[None, :],
                 q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(s_ptr + tl.program_id(0) * n_cb + tl.program_id(1), s)
    return kernel


def _fp8_block_cuda(w, q_out, s_out):
    m, n = w.shape
    w = w if w.stride(-1) == 1 else w.contiguous()
    if q_out.stride(-1) != 1 or not s_out.is_contiguous():
        raise ValueError("quantize_fp8_block_into: Q must be row-contiguous and S contiguous")
    grid = (_cdiv(m, FP8_BLOCK), _cdiv(n, FP8_BLOCK))
    _fp8_block_kernel()[grid](w, q_out, s_out, m, n, w.stride(0), q_out.stride(0), grid[1], BLOCK=FP8_BLOCK,
                              num_warps=8)


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16,
                         block: int = FP8_BLOCK) -> torch.Tensor:
    """(Q e4m3 [out,in], S e8m0|fp32 [ceil(out/128), ceil(in/128)]) -> W = Q * S[i//128, j//128] in `dtype`."""
    _check_2d(q, "dequantize_fp8_block")
    m, n = q.shape
    want = (_cdiv(m, block), _cdiv(n, block))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} does not fit weight {(m, n)}: want {want}")
    s = e8m0_decode(scale) if scale.dtype in (torch.uint8, E8M0_DTYPE) else scale.float()
    return (q.float() * _expand_2d(s, block, block, m, n)).to(dtype)


# ---------------------------------------------------------------------------- FP4 (e2m1) values
def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest e2m1 value (ties to even code), saturating at +-6. NaN stays NaN, sign kept (-0)."""
    a = x.abs().clamp_max(E2M1_MAX)
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))  # grid spacing in [0,2), [2,4), [4,6]
    return torch.copysign(torch.round(a / step) * step, x)  # torch.round is half-to-even


def _fp4_encode(v: torch.Tensor) -> torch.Tensor:
    """On-grid e2m1 values (fp32) -> nibble codes uint8 (bit 3 = sign). NaN encodes as 0."""
    v = torch.nan_to_num(v, nan=0.0)
    code = _FP4_CODE_OF_2X.to(v.device)[(v.abs() * 2).long()]
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def _fp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [out, in/2] -> e2m1 values fp32 [out, in] (element 2k = low nibble, 2k+1 = high)."""
    b = packed.view(torch.uint8)
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)  # [out, in]
    return FP4_VALUES.to(packed.device)[codes.long()]


def quantize_fp4(w: torch.Tensor, block: int = FP4_BLOCK):
    """W [out,in] -> (packed int8 [out, in/2], S float8_e8m0fnu [out, ceil(in/32)]), S = 2^ceil(log2(amax/6))."""
    _check_2d(w, "quantize_fp4")
    m, n = w.shape
    if n % 2:
        raise ValueError(f"quantize_fp4 packs two values per byte: in dim must be even, got {n}")
    amax = _blocks_2d(w.float(), 1, block).abs().amax(dim=(-1, -2))  # [out, ceil(in/32)]
    s = _pow2_scale(amax.clamp_min(FP4_ACT_AMAX_FLOOR), E2M1_MAX)
    v = _round_e2m1(w.float() / _expand_2d(s, 1, block, m, n))
    codes = _fp4_encode(v).view(m, n // 2, 2)  # [out, in/2, (lo, hi)]
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.view(torch.int8), e8m0_encode(s)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16,
                   block: int = FP4_BLOCK) -> torch.Tensor:
    """(packed int8 [out, in/2], S e8m0 [out, ceil(in/32)]) -> W = FP4_VALUES[nib] * S[i, j//32] in `dtype`."""
    _check_2d(packed, "dequantize_fp4")
    m, n = packed.shape[0], packed.shape[1] * 2
    if tuple(scale.shape) != (m, _cdiv(n, block)):
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not fit packed {tuple(packed.shape)}: "
                         f"want {(m, _cdiv(n, block))}")
    return (_fp4_unpack(packed) * _expand_2d(e8m0_decode(scale), 1, block, m, n)).to(dtype)


def fp4_to_fp8(packed: torch.Tensor, scale: torch.Tensor):
    """FP4 expert (packed [out,in/2], e8m0 [out, in/32]) -> FP8 (e4m3 [out,in], e8m0 [ceil(out/128), ceil(in/128)]).

    Per 128x128 tile T: new = max_{T} S32 / 2^6;  Q[i,j] = FP4[i,j] * (S32[i, j//32] / new). Lossless when every
    S32 in T is >= max_T S32 * 2^-14 (see module docstring); the test checks the boundary.
    """
    _check_2d(packed, "fp4_to_fp8")
    m, n = packed.shape[0], packed.shape[1] * 2
    if tuple(scale.shape) != (m, _cdiv(n, FP4_BLOCK)):
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not fit packed {tuple(packed.shape)}")
    if FP8_BLOCK % FP4_BLOCK:
        raise ValueError(f"FP8 block {FP8_BLOCK} must be a multiple of FP4 block {FP4_BLOCK}")
    s32 = e8m0_decode(scale)  # [m, n/32]
    per = FP8_BLOCK // FP4_BLOCK  # 4 scale columns per tile column
    tile_max = _blocks_2d(s32, FP8_BLOCK, per).amax(dim=(-1, -2))  # [Rb,Cb]; zero padding never wins
    if (tile_max < 2.0 ** (FP4_TO_FP8_MAX_OFFSET_BITS - 127)).any():
        raise ValueError(f"fp4_to_fp8: a tile's max FP4 scale {tile_max.min().item()} is below "
                         f"2^{FP4_TO_FP8_MAX_OFFSET_BITS - 127}; the FP8 scale would underflow E8M0")
    new = tile_max / 2.0**FP4_TO_FP8_MAX_OFFSET_BITS  # exact: powers of two
    offset = _expand_2d(s32, 1, FP4_BLOCK, m, n) / _expand_2d(new, FP8_BLOCK, FP8_BLOCK, m, n)
    q = (_fp4_unpack(packed) * offset).to(torch.float8_e4m3fn)
    return q, e8m0_encode(new)


# ---------------------------------------------------------------------------- QAT simulations
class _StraightThrough(torch.autograd.Function):
    """y = fake_quant(x) in the forward, dy/dx = I in the backward (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, fake_quant, *args):
        ctx.n_extra = 1 + len(args)  # fake_quant and its args get no gradient
        return fake_quant(x, *args)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * ctx.n_extra


def _fake_quant_blocks(x, block, qmax, floor, round_fn):
    """Quantize-dequantize per contiguous block of the last dim with a power-of-two scale; returns x.dtype."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} of shape {tuple(x.shape)} is not a multiple of block {block}")
    xb = x.float().reshape(*x.shape[:-1], n // block, block)  # [..., n/block, block]
    s = _pow2_scale(xb.abs().amax(dim=-1, keepdim=True).clamp_min(floor), qmax)  # [..., n/block, 1]
    y = round_fn((xb / s).clamp(-qmax, qmax)) * s
    return y.reshape(x.shape).to(x.dtype)


def _fp8_fake(x, block):
    return _fake_quant_blocks(x, block, E4M3_MAX, FP8_ACT_AMAX_FLOOR,
                              lambda v: v.to(torch.float8_e4m3fn).float())


def _fp4_fake(x, block):
    return _fake_quant_blocks(x, block, E2M1_MAX, FP4_ACT_AMAX_FLOOR, _round_e2m1)


def fp8_sim(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Official act_quant(inplace=True): per 1 x block, s = 2^ceil(log2(max(amax,1e-4)/448)),
    x <- e4m3(clamp(x/s, +-448)) * s. STE backward. Shapes: [..., N] -> [..., N], N % block == 0."""
    return _StraightThrough.apply(x, _fp8_fake, block)


def fp4_sim(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Official fp4_act_quant(inplace=True): per 1 x block, s = 2^ceil(log2(max(amax,6*2^-126)/6)),
    x <- e2m1(clamp(x/s, +-6)) * s. STE backward. Shapes: [..., N] -> [..., N], N % block == 0."""
    return _StraightThrough.apply(x, _fp4_fake, block)


SGLANG_INDEX_AMAX_FLOOR = 1e-4  # SGLang 0.5.16's fmaxf(1e-4f, abs_max) in both indexer FP8 kernels (cited below)


def fp8_index_sim(x: torch.Tensor) -> torch.Tensor:
    """The C4 indexer's q or key as SGLang 0.5.16 hands it to DeepGEMM's `fp8_paged_mqa_logits` on Hopper,
    dequantized: y = hadamard(x) in fp32, then per row of the last dim (one (token, head) of q, one entry of the
    keys) s = max(amax |y|, 1e-4) / 448 in fp32, y <- e4m3(clamp(y * (1/s), +-448)) * s.

    Sources (the sglang-0.5.16 wheel): q -- `jit_kernel/csrc/deepseek_v4/main_norm_rope.cuh` 434-586
    (`fused_q_indexer_rope_hadamard_quant`: rope, the 128-point Hadamard x 128^-0.5, `scale = fmaxf(1e-4f,
    abs_max) / FP8_E4M3_MAX`, `inv_scale = 1 / scale`; the scale is folded into the head weight, `weights_out =
    weight * weight_scale * scale`); keys -- `srt/layers/attention/dsv4/compressor.py` 64-157 + 191-229 (fp32
    norm and rope, `rotate_activation`, then `set_index_k_fused` as `SGLANG_OPT_USE_FUSED_STORE_CACHE` defaults
    on) -> `jit_kernel/csrc/deepseek_v4/store.cuh` 79-120 (`fused_store_indexer_cache`: 128 FP8 values + one
    fp32 scale per entry, "use normal fp32 scale"); the cast -- `jit_kernel/include/sgl_kernel/deepseek_v4/
    fp8_utils.cuh` `pack_fp8` (clip to +-448, round to nearest even); the score -- `srt/layers/attention/dsv4/
    indexer.py` `fp8_paged_mqa_logits_torch` 55-118, DeepGEMM's reference: sum_h relu(q8_h . k8) * w_h * s_k.
    With both scales multiplied back in, that score is `Indexer`'s sum_h relu(q_h . k) * w_h on these values.
    Not modelled: SGLang's fp32 (we: bf16) rounding of the rotated operands before quantization, and the FP8
    MMA's accumulation order. Returns fp32 (the dequantized values, exact in fp32). No gradient flows through
    the indexer's selection, so none is defined here. Shapes: [..., d] -> [..., d] fp32, d a power of 2."""
    y = hadamard(x.float())                                                             # [..., d] fp32
    s = y.abs().amax(-1, keepdim=True).clamp_min(SGLANG_INDEX_AMAX_FLOOR) / E4M3_MAX    # [..., 1]
    return (y * (1.0 / s)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s


# ---------------------------------------------------------------------------- Hadamard
@functools.lru_cache(maxsize=16)
def _sylvester_matrix(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Unscaled +-1 Sylvester matrix [n, n], built by H_2m = [[H, H], [H, -H]] (exact, symmetric). Read-only."""
    with torch.inference_mode(False), torch.no_grad():  # a normal tensor even if first built under inference
        h = torch.ones(1, 1, device=device, dtype=dtype)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # [2m, 2m]
    return h


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """y = H_n x / sqrt(n) over the last dim, Sylvester order: H_1 = [1], H_2n = [[H, H], [H, -H]].

    Computed as one GEMM with a cached +-1 matrix in fp32 (fp64 stays fp64), then scaled and cast back to
    x.dtype, like `fast_hadamard_transform` (fp32 inside, one rounding at the end). Why a matrix and not the
    O(n log n) butterfly: n is 128 in V4 (indexer head dim), where one GEMM is ~4x faster than log2(n)
    elementwise passes on CPU (measured: 0.23 s vs 0.91 s for [8,512,64,128]) and is what GPUs do best; the
    matrix costs n^2 floats (64 KiB at n=128), cached per (n, device, dtype). Caveat: with TF32 matmuls
    enabled on a GPU the +-1 GEMM would round x to 10 mantissa bits; the default (TF32 off) is exact-ish.
    Orthogonal and symmetric, hence self-inverse; differentiable (grad = H^T g / sqrt(n) = H g / sqrt(n)).
    Shapes: [..., n] -> [..., n], n a power of 2.
    """
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard needs a power-of-2 last dim, got shape {tuple(x.shape)}")
    compute = torch.promote_types(x.dtype, torch.float32)  # fp32 inside; fp64 stays fp64 (gradcheck)
    h = _sylvester_matrix(n, x.device, compute)
    return ((x.to(compute) @ h) * n**-0.5).to(x.dtype)  # [..., n]; h is symmetric so x @ h = (H x^T)^T
