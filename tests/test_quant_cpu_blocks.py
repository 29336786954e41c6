"""The weight stream's CPU FP8 quantizer (`quant.quantize_fp8_block_into`) against a naive per-block loop.

The CPU path quantizes a weight in slabs of rows (`QUANT_SLAB_BYTES` of fp32 per slab) so its temporaries stay
bounded. A slab whose row count is not a multiple of 128 cuts a 128x128 block in two: each piece gets its own
amax, and the next slab's scales overwrite the shared block row, so Q and S are wrong there. Only the GPU tests
ran it at V4's sizes, and the small CPU tests fit in one slab, so such a slab formula passed the whole suite.

Reference: `_naive_blocks`, a Python loop over every 128x128 block (ragged edge blocks included) that applies
Miles' `blockwise_cast_to_fp8_triton` convention by hand: S = max(amax, 1e-10) / 448 in fp32, Q =
e4m3(clamp(W * (1/S), +-448)). It shares no code with `quant.py`; the quantizer must match it bit for bit.

Shapes: a few real V4 widths (Flash's 4096 / 8192 inputs and V4-Pro's 7168, whose default slab rounds 585 rows
down to 512) with several slabs each, ragged shapes (not multiples of 128), and small weights with
`QUANT_SLAB_BYTES` shrunk so that the multi-slab logic runs cheaply at many slab sizes.

Run: pytest tests/test_quant_cpu_blocks.py -q
"""
import pytest
import torch

from nanoflash import quant
from nanoflash.quant import quantize_fp8_block, quantize_fp8_block_into

BLOCK = 128           # the served layout's block (SGLang weight_block_size [128, 128]); written out, not imported
E4M3_MAX = 448.0
AMAX_EPS = 1e-10      # Miles' eps in blockwise_cast_to_fp8_triton


def _naive_blocks(w: torch.Tensor):
    """(Q e4m3 [m,n], S fp32 [ceil(m/128), ceil(n/128)]) one block at a time."""
    m, n = w.shape
    w = w.float()
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-m // BLOCK), -(-n // BLOCK), dtype=torch.float32)
    for bi, r in enumerate(range(0, m, BLOCK)):
        for bj, c in enumerate(range(0, n, BLOCK)):
            blk = w[r:r + BLOCK, c:c + BLOCK]
            amax = torch.maximum(blk.abs().max(), torch.tensor(AMAX_EPS, dtype=torch.float32))
            scale = amax / torch.tensor(E4M3_MAX, dtype=torch.float32)           # IEEE fp32 division
            inv = torch.tensor(1.0, dtype=torch.float32) / scale
            q[r:r + BLOCK, c:c + BLOCK] = (blk * inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            s[bi, bj] = scale
    return q, s


def _weight(shape, dtype, gen):
    """Rows of very different magnitude (0.01 .. 100 per 64-row band), so that a block cut by a slab edge gets
    a different amax in each piece and the error cannot hide."""
    m, n = shape
    band = 10.0 ** (torch.arange(m) // 64 % 5 - 2).float()                          # [m]
    return (torch.randn(m, n, generator=gen) * band[:, None]).to(dtype)


def _check(w):
    m, n = w.shape
    q, s = torch.empty(m, n, dtype=torch.float8_e4m3fn), torch.empty(-(-m // BLOCK), -(-n // BLOCK))
    quantize_fp8_block_into(w, q, s)
    q_ref, s_ref = _naive_blocks(w)
    bad_s = (s != s_ref).nonzero()
    assert bad_s.numel() == 0, f"{tuple(w.shape)}: {len(bad_s)} scales differ, first block {bad_s[0].tolist()}"
    bad_q = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
    assert bad_q.numel() == 0, f"{tuple(w.shape)}: {len(bad_q)} FP8 values differ, first at {bad_q[0].tolist()}"


@pytest.mark.parametrize("shape,dtype", [
    ((3072, 7168), torch.bfloat16),     # V4-Pro shared-expert w1 [moe_inter, dim]: default slab 512 rows, 6 slabs
    ((4096, 8192), torch.float32),      # V4-Flash wo_b [dim, o_groups * o_lora_rank]: 512-row slabs, 8 slabs
    ((1100, 7131), torch.bfloat16),     # ragged both ways at a V4-Pro-like width: partial last block row/column
])
def test_cpu_quantizer_matches_naive_blocks_at_v4_widths(shape, dtype, gen):
    """Bug caught: CPU slabs whose row count is not a multiple of 128 (e.g. the slab's row count not rounded
    down to whole blocks: 585 rows at width 7168), or scales written at the wrong block row."""
    assert shape[0] * shape[1] * 4 > quant.QUANT_SLAB_BYTES, "one slab only: the slab logic would not run"
    _check(_weight(shape, dtype, gen))


@pytest.mark.parametrize("slab_rows", [200, 333, 128, 300, 700])
@pytest.mark.parametrize("shape", [(1000, 300), (1024, 256), (130, 129)])
def test_cpu_quantizer_matches_naive_blocks_with_small_slabs(shape, slab_rows, gen, monkeypatch):
    """Bug caught: the same slab bugs, at many slab sizes, cheaply: QUANT_SLAB_BYTES shrunk to `slab_rows` rows of
    this width, mostly not a multiple of 128, so the quantizer must round to whole blocks itself."""
    monkeypatch.setattr(quant, "QUANT_SLAB_BYTES", 4 * shape[1] * slab_rows)
    _check(_weight(shape, torch.float32, gen))


def test_reference_quantizer_matches_naive_blocks_on_ragged_shapes(gen):
    """Bug caught: the one-shot reference (`quantize_fp8_block(fmt="fp32")`, what the slabs call) wrong on
    ragged edge blocks (a zero-padded edge taken into 1/S or the clamp), checked by the same loop."""
    for shape in [(257, 130), (129, 383), (5, 7)]:
        w = _weight(shape, torch.float32, gen)
        q, s = quantize_fp8_block(w, fmt="fp32")
        q_ref, s_ref = _naive_blocks(w)
        assert torch.equal(s, s_ref), shape
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), shape
