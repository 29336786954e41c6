"""Tests for nanoflash/quant.py: E8M0, FP8 128x128 blocks (ue8m0 and Miles fp32), FP4 packing, FP4->FP8,
QAT simulations with STE, Hadamard. References are deliberately naive per-block Python loops.

Run: pytest tests/test_quant.py -q
"""
import math

import numpy as np
import pytest
import torch

from nanoflash import quant as Q

# e4m3 has 3 mantissa bits: round-to-nearest errs by at most half an ulp = 2^-4 of the value's binade;
# below the smallest normal (2^-6, in units of the block scale) the grid is uniform with step 2^-9.
FP8_REL_ERR = 2.0**-4
FP8_MIN_NORMAL = 2.0**-6
# e2m1 has 1 mantissa bit: half-spacing is 1/4 of the binade ([1,2): 0.25, [2,4): 0.5, [4,6]: 1), and below
# 1 (in units of the scale) the grid step is 0.5, so the absolute error there is <= 0.25 * scale.
FP4_REL_ERR = 2.0**-2
FP4_MIN_NORMAL = 1.0
# Miles' non-power-of-two scale adds two fp32 roundings (1/S and W*(1/S)), each <= 2^-24 relative.
FP32_SLACK = 2.0**-20
# fp32 butterfly vs fp32 matmul on O(1) inputs with n <= 256: different summation orders, ~1e-6 apart.
HADAMARD_FP32_TOL = 1e-5
HADAMARD_FP64_TOL = 1e-12  # fp64: both sides are exact up to ~1e-15


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _weights(m, n, seed=0):
    """Gaussian weights whose rows span ~6 binades so blocks get different scales."""
    g = _gen(seed)
    return torch.randn(m, n, generator=g) * torch.exp2(torch.randint(-12, -6, (m, 1), generator=g).float())


# ---------------------------------------------------------------------------- E8M0
def test_e8m0_decode_every_byte():
    got = Q.e8m0_decode(torch.arange(256, dtype=torch.uint8))
    for b in range(255):
        assert got[b].item() == math.ldexp(1.0, b - 127), (b, got[b].item())
    assert math.isnan(got[255].item())
    as_e8m0 = torch.arange(256, dtype=torch.uint8).view(Q.E8M0_DTYPE)
    torch.testing.assert_close(Q.e8m0_decode(as_e8m0), got, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(as_e8m0.float(), got, rtol=0, atol=0, equal_nan=True)  # torch's own decode


def test_e8m0_encode_exact_for_powers_of_two_and_rounds_up_otherwise():
    b = torch.arange(255, dtype=torch.uint8)
    enc = Q.e8m0_encode(Q.e8m0_decode(b))
    assert enc.dtype == Q.E8M0_DTYPE
    assert torch.equal(enc.view(torch.uint8), b)
    cases = {0.7: 127, 1.0: 127, 1.0000001: 128, 3.0: 129, 2.0**-130: 0, 0.0: 0, 2.0**127: 254,
             -1.0: 255, float("nan"): 255, float("inf"): 255, 1.5 * 2.0**127: 255}
    got = Q.e8m0_encode(torch.tensor(list(cases))).view(torch.uint8).tolist()
    assert got == list(cases.values()), dict(zip(cases, got))


# ---------------------------------------------------------------------------- FP8 blocks
SHAPES = [(1, 1), (128, 128), (127, 129), (300, 200), (129, 257)]


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_scale_grid_and_round_trip(fmt, shape):
    w = _weights(*shape, seed=shape[0])
    q, s = Q.quantize_fp8_block(w, fmt)
    grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.shape == grid and s.dtype == (Q.E8M0_DTYPE if fmt == "ue8m0" else torch.float32)
    s_el = Q._expand_2d(Q.e8m0_decode(s) if fmt == "ue8m0" else s, 128, 128, *shape)
    err = (Q.dequantize_fp8_block(q, s, torch.float32) - w).abs()
    bound = FP8_REL_ERR * torch.maximum(w.abs(), FP8_MIN_NORMAL * s_el) * (1 + FP32_SLACK)
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


def test_fp8_ue8m0_scales_are_pow2_ceil_of_amax():
    w = _weights(300, 200, seed=3)
    w[128:256, :128] = 0.0  # all-zero block -> floor -> 2^-126
    _, s = Q.quantize_fp8_block(w, "ue8m0")
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            amax = max(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max().item(),
                       Q.FP8_WEIGHT_AMAX_FLOOR)
            r = float(np.float32(amax) * np.float32(1 / 448))
            want = math.ceil(math.log2(r)) + 127
            assert s.view(torch.uint8)[i, j].item() == want, (i, j, amax)
    assert s.view(torch.uint8)[1, 0].item() == 1  # 2^-126


def _miles_reference(w):
    """Per-block loop of Miles/slime blockwise_cast_to_fp8_triton, one block at a time, in fp32."""
    m, n = w.shape
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(m / 128), math.ceil(n / 128))
    for i in range(0, m, 128):
        for j in range(0, n, 128):
            blk = w[i:i + 128, j:j + 128].float()
            amax = torch.maximum(blk.abs().max(), torch.tensor(1e-10))
            scale = amax / torch.tensor(448.0)
            s_inv = torch.tensor(1.0) / scale
            q[i:i + 128, j:j + 128] = torch.clamp(blk * s_inv, -448.0, 448.0).to(torch.float8_e4m3fn)
            s[i // 128, j // 128] = scale
    return q, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_fp32_miles_matches_naive_loop_bit_for_bit(dtype):
    w = _weights(260, 300, seed=7).to(dtype)
    w[0:128, 128:256] = 0.0  # eps path
    w[200, 5] = 1e3  # one outlier block: everything else in it is pushed toward e4m3 subnormals
    if dtype == torch.float32:  # a pair where W/S and W*(1/S) round to different e4m3 codes (82 vs 83),
        w[130, 260] = float.fromhex("0x1.989bd4p-1")  # so this pins Miles' reciprocal-multiply: block amax
        w[131, 261] = float.fromhex("0x1.3274ep-6")
    q, s = Q.quantize_fp8_block(w, "fp32")
    q_ref, s_ref = _miles_reference(w)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_dequantize_fp8_rejects_mismatched_scale(gen):
    q, s = Q.quantize_fp8_block(torch.randn(130, 10, generator=gen), "fp32")
    with pytest.raises(ValueError, match="scale shape"):
        Q.dequantize_fp8_block(q, s[:1])
    with pytest.raises(ValueError, match="fmt"):
        Q.quantize_fp8_block(torch.randn(4, 4, generator=gen), "e5m2")
    with pytest.raises(ValueError, match="2-D"):
        Q.quantize_fp8_block(torch.randn(4, generator=gen))


# ---------------------------------------------------------------------------- FP4
def _nearest_e2m1(v):
    """Brute force: nearest of the 8 magnitudes; ties go to the even code (mantissa bit 0)."""
    a = min(abs(v), 6.0)
    grid = Q.FP4_VALUES[:8].tolist()
    d = [abs(a - g) for g in grid]
    best = min(d)
    codes = [c for c in range(8) if d[c] == best]
    code = codes[0] if len(codes) == 1 else next(c for c in codes if c % 2 == 0)
    return math.copysign(grid[code], v)


def test_e2m1_rounding_ties_to_even_and_saturates():
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0, 7.0: 6.0, -5.0: -4.0}
    got = Q._round_e2m1(torch.tensor(list(ties))).tolist()
    assert got == list(ties.values()), dict(zip(ties, got))
    x = torch.randn(2000, generator=_gen(1)) * 3
    assert Q._round_e2m1(x).tolist() == [_nearest_e2m1(v) for v in x.tolist()]


def test_fp4_packing_nibble_order_against_hand_built_bytes():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([1.0, -0.5, 6.0, 0.0])  # amax 6 -> scale 2^0
    packed, s = Q.quantize_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (1, 16) and s.shape == (1, 1)
    # byte 0: low nibble = code(1.0) = 0b0010, high nibble = code(-0.5) = 0b1001 -> 0x92
    # byte 1: low nibble = code(6.0) = 0b0111, high nibble = code(0.0) = 0 -> 0x07
    assert packed.view(torch.uint8)[0, :3].tolist() == [0x92, 0x07, 0x00]
    assert s.view(torch.uint8).item() == 127
    assert Q.dequantize_fp4(packed, s, torch.float32)[0, :4].tolist() == [1.0, -0.5, 6.0, 0.0]


@pytest.mark.parametrize("shape", [(1, 2), (3, 32), (130, 80), (256, 512)])
def test_fp4_round_trip_within_bound(shape):
    w = _weights(*shape, seed=shape[1])
    packed, s = Q.quantize_fp4(w)
    assert packed.shape == (shape[0], shape[1] // 2) and s.shape == (shape[0], math.ceil(shape[1] / 32))
    s_el = Q._expand_2d(Q.e8m0_decode(s), 1, 32, *shape)
    amax = Q._blocks_2d(w, 1, 32).abs().amax(dim=(-1, -2))
    assert torch.equal(Q.e8m0_decode(s), torch.exp2(torch.ceil(torch.log2(amax / 6))))
    err = (Q.dequantize_fp4(packed, s, torch.float32) - w).abs()
    assert (err <= FP4_REL_ERR * torch.maximum(w.abs(), FP4_MIN_NORMAL * s_el)).all()


def _random_fp4_expert(m, n, seed, spread_bits):
    """Packed codes uniform over all 16 nibbles; scales 2^[-20, -20+spread_bits] (realistic spread <= 2^14)."""
    g = _gen(seed)
    packed = torch.randint(0, 256, (m, n // 2), generator=g, dtype=torch.uint8).view(torch.int8)
    exps = torch.randint(107, 108 + spread_bits, (m, math.ceil(n / 32)), generator=g, dtype=torch.uint8)
    return packed, exps.view(Q.E8M0_DTYPE)


@pytest.mark.parametrize("shape", [(256, 512), (200, 96), (128, 32)])
def test_fp4_to_fp8_is_exactly_lossless(shape):
    packed, s = _random_fp4_expert(*shape, seed=shape[0], spread_bits=14)
    q8, s8 = Q.fp4_to_fp8(packed, s)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == shape
    assert s8.dtype == Q.E8M0_DTYPE and s8.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    want = Q.dequantize_fp4(packed, s, torch.float32)
    assert torch.equal(Q.dequantize_fp8_block(q8, s8, torch.float32), want)


def test_fp4_to_fp8_loses_values_only_past_a_2pow14_scale_spread():
    packed = torch.full((128, 64), 0x11, dtype=torch.uint8).view(torch.int8)  # every value 0.5
    s = torch.full((128, 4), 127, dtype=torch.uint8)
    s[0, 0] = 127 + 14  # max scale 2^14 above the rest: 0.5 * 2^-8 = 2^-9, e4m3's smallest subnormal
    back = Q.dequantize_fp8_block(*Q.fp4_to_fp8(packed, s.view(Q.E8M0_DTYPE)), dtype=torch.float32)
    assert torch.equal(back, Q.dequantize_fp4(packed, s.view(Q.E8M0_DTYPE), torch.float32))
    s[0, 0] = 127 + 15  # one more binade: 0.5 * 2^-9 = 2^-10 rounds (tie to even) to 0
    back = Q.dequantize_fp8_block(*Q.fp4_to_fp8(packed, s.view(Q.E8M0_DTYPE)), dtype=torch.float32)
    assert back[1, 0].item() == 0.0 and back[0, 0].item() == 0.5 * 2.0**15


# ---------------------------------------------------------------------------- QAT simulations
def _fp8_sim_reference(x, block):
    """Per-row, per-block loop of official act_quant(inplace=True), scale via math.log2 in double."""
    xf = x.float().reshape(-1, x.shape[-1])
    out = torch.empty_like(xf)
    for r in range(xf.shape[0]):
        for j in range(0, xf.shape[1], block):
            blk = xf[r, j:j + block]
            amax = max(blk.abs().max().item(), 1e-4)
            s = 2.0 ** math.ceil(math.log2(float(np.float32(amax) * np.float32(1 / 448))))
            out[r, j:j + block] = (blk / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return out.reshape(x.shape).to(x.dtype)


def _fp4_sim_reference(x, block):
    xf = x.float().reshape(-1, x.shape[-1])
    out = torch.empty_like(xf)
    for r in range(xf.shape[0]):
        for j in range(0, xf.shape[1], block):
            blk = xf[r, j:j + block]
            amax = max(blk.abs().max().item(), 6 * 2.0**-126)
            s = 2.0 ** math.ceil(math.log2(float(np.float32(amax) * np.float32(1 / 6))))
            out[r, j:j + block] = torch.tensor([_nearest_e2m1(v / s) * s for v in blk.tolist()])
    return out.reshape(x.shape).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [64, 128])
def test_fp8_sim_matches_naive_loop(dtype, block):
    x = (torch.randn(2, 3, 256, generator=_gen(block)) * torch.logspace(-6, 2, 256)).to(dtype)
    x[0, 0, :block] = 0.0  # floor path
    y = Q.fp8_sim(x, block)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, _fp8_sim_reference(x, block))
    assert torch.equal(Q.fp8_sim(y, block), y)  # property: idempotent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_sim_matches_naive_loop(dtype):
    x = (torch.randn(3, 2, 64, generator=_gen(5)) * torch.logspace(-4, 1, 64)).to(dtype)
    x[1, 1, 32:] = 0.0
    y = Q.fp4_sim(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, _fp4_sim_reference(x, 32))
    assert torch.equal(Q.fp4_sim(y), y)


@pytest.mark.parametrize("sim", [lambda t: Q.fp8_sim(t, 64), Q.fp4_sim])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sim_gradient_is_identity(sim, dtype):
    x = torch.randn(4, 128, generator=_gen(2)).to(dtype).requires_grad_()
    upstream = torch.randn(4, 128, generator=_gen(3)).to(dtype)
    sim(x).backward(upstream)
    assert torch.equal(x.grad, upstream)


def test_sim_rejects_ragged_last_dim(gen):
    with pytest.raises(ValueError, match="not a multiple of block"):
        Q.fp8_sim(torch.randn(2, 100, generator=gen), 64)


# ---------------------------------------------------------------------------- non-finite inputs
def test_nonfinite_input_poisons_only_its_block():
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = torch.randn(256, 256, generator=_gen(9))
        w[3, 200] = bad  # block (0, 1) for FP8, row 3 / block 6 for FP4
        for fmt in ("ue8m0", "fp32"):
            dq = Q.dequantize_fp8_block(*Q.quantize_fp8_block(w, fmt), dtype=torch.float32)
            assert dq[:128, 128:].isnan().all(), (bad, fmt)
            assert dq[:, :128].isfinite().all() and dq[128:].isfinite().all(), (bad, fmt)
        dq = Q.dequantize_fp4(*Q.quantize_fp4(w), dtype=torch.float32)
        assert dq[3, 192:224].isnan().all() and dq.isnan().sum() == 32, bad
        y = Q.fp8_sim(w, 128)
        assert y[3, 128:].isnan().all() and y.isnan().sum() == 128, bad
        y = Q.fp4_sim(w)
        assert y[3, 192:224].isnan().all() and y.isnan().sum() == 32, bad


# ---------------------------------------------------------------------------- Hadamard
def _sylvester(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)  # [[H,H],[H,-H]]
    return h


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 128, 256])
def test_hadamard_matches_kronecker_matrix(n):
    h = _sylvester(n) * n**-0.5
    assert torch.equal(h, h.T)
    x = torch.randn(3, 2, n, generator=_gen(n), dtype=torch.float64)
    torch.testing.assert_close(Q.hadamard(x), x @ h.T, rtol=0, atol=HADAMARD_FP64_TOL)
    torch.testing.assert_close(Q.hadamard(x.float()), (x @ h.T).float(), rtol=0, atol=HADAMARD_FP32_TOL)
    torch.testing.assert_close(Q.hadamard(torch.eye(n, dtype=torch.float64)), h, rtol=0, atol=HADAMARD_FP64_TOL)


def test_hadamard_orthogonal_self_inverse_differentiable(gen):
    x = torch.randn(5, 128, generator=_gen(4))
    y = Q.hadamard(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=HADAMARD_FP32_TOL, atol=0)
    torch.testing.assert_close(Q.hadamard(y), x, rtol=0, atol=HADAMARD_FP32_TOL)
    assert Q.hadamard(x.bfloat16()).dtype == torch.bfloat16
    xd = torch.randn(2, 16, dtype=torch.float64, requires_grad=True, generator=gen)
    assert torch.autograd.gradcheck(Q.hadamard, (xd,))
    with pytest.raises(ValueError, match="power-of-2"):
        Q.hadamard(torch.randn(3, 96, generator=gen))


def test_hadamard_cache_built_under_inference_mode_still_trains(gen):
    n = 32  # a size no other test uses, so the cached matrix is first built here, under inference_mode
    with torch.inference_mode():
        Q.hadamard(torch.randn(2, n, generator=gen))
    x = torch.randn(2, n, requires_grad=True, generator=gen)
    Q.hadamard(x).sum().backward()
    torch.testing.assert_close(x.grad, Q.hadamard(torch.ones(2, n)), rtol=0, atol=HADAMARD_FP32_TOL)
