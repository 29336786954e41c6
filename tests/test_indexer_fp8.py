"""SGLang's FP8 index scores as an option of the model (`ModelConfig.indexer_quant="fp8"`, `quant.fp8_index_sim`).

SGLang 0.5.16 on Hopper scores the C4 lightning indexer with DeepGEMM's `fp8_paged_mqa_logits`: q per
(token, head) and every indexer key per entry are Hadamard-rotated and cast to one FP8 e4m3 row with an fp32
scale amax/448, the q scale folded into the head weight, the key scale applied after the head sum. These tests
rebuild that computation naively (the warp butterfly of the CUDA kernels, an explicit e4m3 grid with ties to
even, the scores in SGLang's order of scales) and check the model's option against it, then check that the
option changes the indexer and nothing else.
"""
import itertools
import math

import pytest
import torch

from nanoflash.config import preset
from nanoflash.model import Transformer, index_scores, index_sim
from nanoflash.quant import fp8_index_sim

SCORE_RTOL = 1e-5   # the same fp32 sums in two orders (scales folded in before vs after the head sum)
ULP_RTOL = 1e-6     # one rotated row summed as a butterfly (the kernels) vs one fp32 GEMM (quant.hadamard): the
                    # scale amax/448 may differ in its last fp32 bit; an FP8 code flip would be >= 2^-4 off


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny forwards, one thread


def e4m3_grid() -> list:
    """Every finite non-negative float8_e4m3fn value, built from its bits (bias 7; e=15, m=7 is NaN)."""
    vals = [m / 8 * 2.0 ** -6 for m in range(8)]                                   # subnormals (e = 0)
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]
    return vals


GRID = e4m3_grid()


def round_e4m3(v: float) -> float:
    """Nearest e4m3 value (ties to the even code, i.e. the even index on the grid), saturating at 448."""
    a = min(abs(v), 448.0)
    i = min(range(len(GRID)), key=lambda j: (abs(GRID[j] - a), j % 2))   # on a tie the even code wins
    return math.copysign(GRID[i], v)


def butterfly_hadamard(row: list) -> list:
    """The 128-point transform of SGLang's indexer kernels: a butterfly over every bit of the element index
    (lower index keeps a + b, upper keeps a - b), then x n^-0.5 -- written out, not as a matrix."""
    x, n = list(row), len(row)
    for bit in range(int(math.log2(n))):
        step = 1 << bit
        for i in range(n):
            if not i & step:
                a, b = x[i], x[i | step]
                x[i], x[i | step] = a + b, a - b
    return [v / math.sqrt(n) for v in x]


def naive_quant(row: list) -> tuple:
    """(FP8 values as floats, fp32 scale) of one rotated row, as `fused_store_indexer_cache` writes it."""
    y = butterfly_hadamard(row)
    s = float(torch.tensor(max(max(abs(v) for v in y), 1e-4), dtype=torch.float32) / 448.0)
    inv = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(s, dtype=torch.float32))
    return [round_e4m3(float(torch.tensor(v, dtype=torch.float32) * inv)) for v in y], s


def naive_scores(q, keys, w) -> torch.Tensor:
    """DeepGEMM's reference order: logits[t,u] = (sum_h relu(q8[t,h] . k8[u]) * (w[t,h] * q_scale[t,h])) * k_scale[u],
    visible entries only (u < (t+1)//4), else -inf. q [S,HI,d], keys [C,d], w [S,HI] -> [S,C] (float64)."""
    S, HI, _ = q.shape
    kq = [naive_quant(keys[u].tolist()) for u in range(keys.shape[0])]
    out = torch.full((S, keys.shape[0]), float("-inf"), dtype=torch.float64)
    for t in range(S):
        qq = [naive_quant(q[t, h].tolist()) for h in range(HI)]
        for u, (k8, ks) in enumerate(kq):
            if u < (t + 1) // 4:
                acc = sum(max(sum(a * b for a, b in zip(q8, k8)), 0.0) * float(w[t, h]) * qs
                          for h, (q8, qs) in enumerate(qq))
                out[t, u] = acc * ks
    return out


def test_grid_rounding_matches_the_hardware_cast_including_ties():
    """The naive e4m3 rounding (the reference below) agrees with torch's cast on grid points, midpoints and
    random values -- so the reference is independent of, and consistent with, the cast under test."""
    mids = [(a + b) / 2 for a, b in zip(GRID, GRID[1:])]
    vals = GRID + mids + torch.randn(200, generator=torch.Generator().manual_seed(0)).mul(40).tolist()
    for v in vals + [-x for x in vals] + [500.0, -1e6]:
        t = float(torch.tensor(min(max(v, -448.0), 448.0)).to(torch.float8_e4m3fn).float())
        assert round_e4m3(v) == t, v


def test_fp8_index_sim_is_sglangs_per_row_fp8_after_the_hadamard():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 128, generator=g) * torch.tensor([0.01, 1.0, 30.0, 1e-6, 3.0])[:, None]  # incl. a floored row
    got = fp8_index_sim(x)
    for r in range(x.shape[0]):
        q8, s = naive_quant(x[r].tolist())
        want = torch.tensor(q8, dtype=torch.float32) * torch.tensor(s, dtype=torch.float32)
        assert torch.allclose(got[r], want, rtol=ULP_RTOL, atol=0), f"row {r}: max diff {(got[r] - want).abs().max()}"
    assert got.dtype == torch.float32


def test_fp8_scores_and_selection_match_the_naive_sglang_computation():
    """The model's scores on `index_sim` operands equal DeepGEMM's order of scales to fp32 rounding, and the
    kept top-k sets agree wherever the k-th and (k+1)-th naive scores are not within that rounding."""
    cfg = preset("tiny", indexer_quant="fp8", index_head_dim=128, index_n_heads=3)
    g = torch.Generator().manual_seed(2)
    S, C, k = 40, 10, 4
    q, keys = torch.randn(1, S, 3, 128, generator=g), torch.randn(1, C, 128, generator=g)
    w = torch.randn(1, S, 3, generator=g)
    got = index_scores(index_sim(cfg, q), index_sim(cfg, keys), w, 0)[0].double()          # [S,C]
    want = naive_scores(q[0], keys[0], w[0])
    vis = torch.isfinite(want)
    assert torch.equal(vis, torch.isfinite(got))
    assert torch.allclose(got[vis], want[vis], rtol=SCORE_RTOL, atol=SCORE_RTOL * want[vis].abs().max().item())
    for t in range(S):
        n = int(vis[t].sum())
        if n <= k:
            continue
        order = want[t, :n].sort(descending=True).values
        if order[k - 1] - order[k] > 2 * SCORE_RTOL * order.abs().max():   # not a near tie at the cut
            assert set(got[t].topk(k).indices.tolist()) == set(want[t].topk(k).indices.tolist()), t


def test_fp8_index_scores_change_the_selection_and_nothing_else():
    """indexer_quant="fp8" touches only the indexer's operands: with top-k >= every entry (nothing to select)
    the logits are bit-identical to the plain model's; with a top-k that selects, some query keeps another set.
    And "qat" keeps today's behaviour: the plain model without qat, the official FP4 QAT with it."""
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3))
    base = dict(index_head_dim=16)
    plain = Transformer(preset("tiny", index_topk=64, **base)).init_weights(0).eval()
    fp8 = Transformer(preset("tiny", index_topk=64, indexer_quant="fp8", **base)).eval()
    fp8.load_state_dict(plain.state_dict())
    with torch.no_grad():
        assert torch.equal(plain(ids), fp8(ids)), "fp8 index scores moved a logit where nothing is selected"
        sel = {}
        for name in ("none", "fp8"):
            m = Transformer(preset("tiny", index_topk=2, indexer_quant=name, **base)).eval()
            m.load_state_dict(plain.state_dict())
            idx = m.layers["1"].attn.indexer
            x = torch.randn(1, 48, m.cfg.dim, generator=torch.Generator().manual_seed(4))
            qr = torch.randn(1, 48, m.cfg.q_lora_rank, generator=torch.Generator().manual_seed(5))
            sel[name] = idx(x, qr, 0, None)[0]
        assert not torch.equal(sel["none"], sel["fp8"]), "FP8 scores never changed a kept set"
        assert torch.equal(sel["none"].sum(-1), sel["fp8"].sum(-1))   # the same count, other entries
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(6))
    assert torch.equal(index_sim(preset("tiny"), x), x)
    assert not torch.equal(index_sim(preset("tiny", qat=True), x), x)
    assert torch.equal(index_sim(preset("tiny", qat=True), x), index_sim(preset("tiny", indexer_quant="fp4"), x))
    assert torch.equal(index_sim(preset("tiny", qat=True, indexer_quant="none"), x), x)
    with pytest.raises(ValueError, match="indexer_quant"):
        preset("tiny", indexer_quant="fp16")


def test_e4m3_grid_is_complete():
    assert len(GRID) == 127 and max(GRID) == 448.0 and GRID == sorted(GRID)   # 0 + 126 positive finite codes
    assert all(a < b for a, b in itertools.pairwise(GRID))
