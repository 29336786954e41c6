"""nanoflash.kernels against model.py's reference on CPU, forward and backward, under Triton's interpreter.

TRITON_INTERPRET=1 must be set before Triton is first imported, so the kernel cases run in ONE subprocess:
this file run as a script (`python tests/test_kernels_attention.py OUT.json`) executes every `case_*`
function and writes {case: "ok" | traceback}; the pytest tests below read that file, one test per case.
The checks that launch no kernel (input errors, the tie-break, the config switch) run in-process.

References (deliberately naive): `model.sink_attention` in float64 over a dense mask built here with Python
loops from the same window and selection lists; the indexer score as a float64 einsum; the top-k as the
reference's stable descending sort.
"""
from __future__ import annotations

import sys

import pytest
import torch

import interp  # tests/interp.py: the kernel cases under Triton's interpreter, in a subprocess

# fp32 kernels vs float64: the interpreter's dots are exact fp32 (numpy), so only a few dozen fp32
# roundings of O(1) values remain (measured <= 1.1e-6 relative to the largest output / gradient, 3 seeds).
FP32_TOL = 1e-5
# bf16 inputs: the kernel rounds p and ds to bf16 before their dots and o / dq / dkv to bf16 at the end
# (2^-8 relative each), as on the GPU; measured <= 1.4e-2 relative to the largest value (dq), 3 seeds.
BF16_TOL = 3e-2
# Indexer scores: fp32 dots in another summation order than the float64 einsum.
SCORE_TOL = 1e-5
INTERP_TIMEOUT_S = 240  # the whole case list takes ~35 s on the 2-core CI box; 7x headroom


# ------------------------------------------------------------------------------------------ shared helpers
def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def dense_mask(S, W, sel=None, C=0):
    """[B|1,S,S+C] bool by loops: key j of the window iff 0 <= t-j < W; entry u iff u in sel[b,t]."""
    B = 1 if sel is None else sel.shape[0]
    m = torch.zeros(B, S, S + C, dtype=torch.bool)
    for b in range(B):
        for t in range(S):
            for j in range(max(0, t - W + 1), t + 1):
                m[b, t, j] = True
            if sel is not None:
                for u in sel[b, t].tolist():
                    if u >= 0:
                        m[b, t, S + u] = True
    return m


def random_selection(B, S, C, K, g, p_none=0.3):
    """Per query K distinct entries of C in random order, each replaced by -1 with probability p_none."""
    sel = torch.stack([torch.stack([torch.randperm(C, generator=g)[:K] for _ in range(S)]) for _ in range(B)])
    return torch.where(torch.rand(sel.shape, generator=g) < p_none, -1, sel)


# ------------------------------------------------------------------------------------------ interpreter cases
def _attention_case(B, S, H, D, W, C, K, dtype, g, batch_sel=True, fused=None, prefix=False, bwd=None, fwd=None):
    from nanoflash.kernels import attention as ka
    from nanoflash.model import sink_attention
    q = torch.randn(B, S, H, D, generator=g).to(dtype).requires_grad_()
    kv = torch.randn(B, S, D, generator=g).to(dtype).requires_grad_()
    sink = torch.randn(H, generator=g).requires_grad_()
    comp = sel = None
    leaves = [q, kv, sink]
    if C:
        comp = torch.randn(B, C, D, generator=g).to(dtype).requires_grad_()
        sel = random_selection(B if batch_sel else 1, S, C, K, g)
        sel[:, 3] = -1                                       # a query that keeps no entry at all
        if prefix:                                           # valid entries first (as model.py's lists)
            sel = sel.sort(-1, descending=True).values
        leaves.append(comp)
    if fused is not None:   # small blocks, as the shapes are small
        blocks = dict(BLOCK_H=16, BLOCK_K=16, num_warps=4, num_stages=2)
        ka.BWD_CONFIG = dict(fused=fused, dq=blocks, dkv=blocks)
    if bwd is not None:
        ka.BWD_CONFIG = bwd
    if fwd is not None:
        ka.FWD_CONFIG = fwd
    out = ka.sparse_attention(q, kv, sink, D ** -0.5, W, comp, sel, prefix=prefix)
    keys = kv if comp is None else torch.cat([kv, comp], 1)
    ref = sink_attention(q.double(), keys.double(), dense_mask(S, W, sel, C), sink.double(), D ** -0.5)
    cot = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad((out.float() * cot).sum(), leaves)
    want = torch.autograd.grad((ref * cot.double()).sum(), leaves)
    return [("o", out, ref)] + [(n, a, b) for n, a, b in zip(["dq", "dkv", "dsink", "dcomp"], got, want)]


def _assert_all(pairs, tol, what):
    for name, a, b in pairs:
        err = rel_err(a, b)
        assert err <= tol, f"{what}: {name} relative error {err:.2e} > {tol:.0e}"


def case_window_only_fp32(g):
    """Sliding layer: window that wraps (S > W), heads and head dim not powers of two (masked lanes)."""
    _assert_all(_attention_case(2, 37, 5, 24, 8, 0, 0, torch.float32, g), FP32_TOL, "window only")


def case_window_and_selection_fp32(g):
    """Window + selection, -1 anywhere in the list, unsorted, one list per batch row and one shared."""
    _assert_all(_attention_case(2, 30, 4, 32, 8, 9, 5, torch.float32, g), FP32_TOL, "per-batch selection")
    _assert_all(_attention_case(2, 30, 4, 32, 1, 9, 5, torch.float32, g, batch_sel=False), FP32_TOL,
                "shared selection, window 1")
    _assert_all(_attention_case(2, 30, 4, 32, 8, 9, 5, torch.float32, g, prefix=True), FP32_TOL,
                "selection already in prefix form (no compaction)")


def case_bf16_split_and_fused_backward(g):
    """bf16 inputs through both backward launch modes (dq + dkv kernels, or one fused kernel)."""
    for fused in (False, True):
        _assert_all(_attention_case(2, 26, 4, 32, 8, 7, 4, torch.bfloat16, g, fused=fused), BF16_TOL,
                    f"bf16 fused={fused}")


def _wgmma(comp_mode="auto", programs=1, chunk=64):
    """A wgmma backward config at test sizes (attention_bwd.py). programs=1: one program per window key
    block (plain store); more: the block's queries in chunks added atomically. chunk < S: the entry pass in
    several query chunks (atomics); chunk >= S: one (plain store)."""
    blocks = dict(num_warps=4, num_stages=1)
    return dict(kind="wgmma", dq=dict(BLOCK_H=16, BLOCK_K=16, **blocks),
                dkv=dict(BLOCK_K=16, BLOCK_R=16, programs=programs, min_chunk=4, **blocks),
                comp=dict(BLOCK_K=16, BLOCK_R=16, chunk=chunk, comp_mode=comp_mode,
                          rows=dict(BLOCK_H=16, BLOCK_K=16, **blocks), **blocks))


def case_wgmma_backward(g):
    """The wgmma backward in each mode against the float64 reference. Bugs it catches: a window range that
    misses the last query of a key block's band (j0 + BK + W - 2) or a chunk boundary; s and dp (or p and ds)
    swapped in the interleaved rows; a selection word read at the wrong bit or block; query chunks that
    drop or repeat a query; the second head tile (20 heads = 16 + 4 masked) skipped; the query-major entry
    pass's atomics. fp32 (exact dots here) and bf16 once."""
    from nanoflash.kernels import attention as ka
    old = ka.BWD_CONFIG
    try:
        _assert_all(_attention_case(2, 30, 20, 32, 8, 9, 5, torch.float32, g, bwd=_wgmma("keys", 1000, 8)),
                    FP32_TOL, "wgmma: window in atomic chunks, entries key-major in query chunks, 2 head tiles")
        _assert_all(_attention_case(2, 30, 4, 32, 1, 9, 5, torch.float32, g, batch_sel=False,
                                    bwd=_wgmma("keys", 1, 64)), FP32_TOL, "wgmma: one program per key block")
        _assert_all(_attention_case(2, 30, 4, 32, 8, 9, 5, torch.float32, g, prefix=True, bwd=_wgmma("rows")),
                    FP32_TOL, "wgmma: entries query-major (atomics)")
        _assert_all(_attention_case(2, 26, 4, 32, 8, 7, 4, torch.bfloat16, g, bwd=_wgmma()), BF16_TOL, "wgmma bf16")
    finally:
        ka.BWD_CONFIG = old


def case_keys_forward(g):
    """The keys-on-M forward (`_fwd_keys`, kind="keys") against the float64 reference: o and lse through the
    gradients (the backward reads lse). Bugs it catches: the softmax max or sum taken over heads instead of keys
    (axis 1 of s^T), the two head-dim halves swapped or one dropped, o^T stored untransposed, the sink left out
    of a query with no keys. Window wider than a key block (two blocks, one partly masked), heads and head dim
    not powers of two, fp32 and bf16."""
    from nanoflash.kernels import attention as ka
    old_f, old_b = ka.FWD_CONFIG, ka.BWD_CONFIG
    keys = dict(kind="keys", BLOCK_H=16, BLOCK_K=16, num_warps=4, num_stages=1)
    try:
        _assert_all(_attention_case(2, 37, 5, 24, 20, 0, 0, torch.float32, g, fwd=keys), FP32_TOL,
                    "keys forward: window only")
        _assert_all(_attention_case(2, 30, 20, 32, 8, 9, 5, torch.float32, g, fwd=keys), FP32_TOL,
                    "keys forward: window + selection, 2 head blocks")
        _assert_all(_attention_case(2, 26, 4, 32, 8, 7, 4, torch.bfloat16, g, fwd=keys, bwd=_wgmma()), BF16_TOL,
                    "keys forward bf16 (wgmma backward)")
    finally:
        ka.FWD_CONFIG, ka.BWD_CONFIG = old_f, old_b


def case_fused_delta_backward(g):
    """The wgmma backward with delta computed in the dq pass (fuse_delta=True), each entry mode, against the
    float64 reference. Bugs it catches: a later pass (dkv, entries) reading delta before the dq pass wrote it
    (the separate delta kernel skipped but the dq pass launched after them), delta summed over heads instead
    of the head dim, the second head tile's delta not written (20 heads), dsink (reads delta) wrong."""
    from nanoflash.kernels import attention as ka
    old = ka.BWD_CONFIG

    def fused(mode, programs=1, chunk=64):
        cfg = _wgmma(mode, programs, chunk)
        return dict(cfg, dq=dict(cfg["dq"], fuse_delta=True))
    try:
        _assert_all(_attention_case(2, 30, 20, 32, 8, 9, 5, torch.float32, g, bwd=fused("keys", 1000, 8)),
                    FP32_TOL, "fused delta: entries key-major, 2 head tiles")
        _assert_all(_attention_case(2, 30, 4, 32, 8, 9, 5, torch.float32, g, prefix=True, bwd=fused("rows")),
                    FP32_TOL, "fused delta: entries query-major")
        _assert_all(_attention_case(2, 37, 5, 24, 8, 0, 0, torch.float32, g, bwd=fused("auto")), FP32_TOL,
                    "fused delta: window only")
        _assert_all(_attention_case(2, 26, 4, 32, 8, 7, 4, torch.bfloat16, g, bwd=fused("auto")), BF16_TOL,
                    "fused delta bf16")
    finally:
        ka.BWD_CONFIG = old


def case_index_scores(g):
    """Fused indexer scores vs a float64 einsum, incl. start_pos > 0 and entries that are not yet visible."""
    from nanoflash.kernels import index_scores
    B, S, HI, DI, C = 2, 23, 5, 16, 9
    q, keys = torch.randn(B, S, HI, DI, generator=g), torch.randn(B, C, DI, generator=g)
    w = torch.randn(B, S, HI, generator=g)
    for start_pos in (0, 13):
        got = index_scores(q, keys, w, start_pos)
        want = (torch.einsum("bshd,bcd->bshc", q.double(), keys.double()).relu() * w.double()[..., None]).sum(2)
        vis = torch.arange(C)[None] < (torch.arange(start_pos, start_pos + S)[:, None] + 1) // 4
        assert torch.equal(torch.isinf(got), ~vis.expand(B, -1, -1)), f"start_pos={start_pos}: -inf pattern"
        assert rel_err(got[:, vis], want[:, vis]) <= SCORE_TOL, f"start_pos={start_pos}: scores"


def _random_attention(lid, cfg, g):
    """Attention layer `lid` of `cfg` with random parameters (sinks and ape at scale 1, the rest 0.3)."""
    from nanoflash.model import Attention
    a = Attention(lid, cfg)
    with torch.no_grad():
        for n, p in a.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 if n.endswith(("attn_sink", "ape")) else 0.3))
    return a


def _out_and_grads(a, x, **kw):
    """[y, dx, d(every parameter)] of sum(y^2) for one forward of layer `a`."""
    y = a(x, **kw)
    return [y] + list(torch.autograd.grad(y.square().sum(), [x] + list(a.parameters()), allow_unused=True))


def _assert_same(a, res, what):
    """The kernels' output and gradients (res["triton"]) against the reference's, within FP32_TOL."""
    for n, mine, ref in zip(["out", "dx"] + [n for n, _ in a.named_parameters()], res["triton"], res["reference"]):
        if ref is None or mine is None:
            assert mine is None and ref is None, f"{what} {n}: gradient present in one path only"
            continue
        assert rel_err(mine, ref) <= FP32_TOL, f"{what} {n}: relative error {rel_err(mine, ref):.2e}"


def case_model_seam(g):
    """Attention (sliding, C4 with a top-k that drops entries, ratio 8) and Indexer with cfg.kernels="triton"
    against cfg.kernels="reference": output, and gradients of the input and of every parameter."""
    import dataclasses
    from nanoflash.config import preset
    cfg = preset("tiny", index_topk=3)
    x = torch.randn(2, 29, cfg.dim, generator=g, requires_grad=True)
    for lid in (0, 1, 2):
        a = _random_attention(lid, cfg, g)
        res = {}
        for mode in ("reference", "triton"):
            a.cfg = dataclasses.replace(cfg, kernels=mode)
            if lid == 1:   # the selection itself: an index list that marks exactly the reference's keep mask
                qr = a.q_norm(a.wq_a(x))
                keep = a.indexer(x, qr, 0, None, None, False)[0]
                sel = a.indexer(x, qr, 0, None, None, True)[0]
                C = keep.shape[-1]
                mine = torch.zeros(*keep.shape[:2], C + 1, dtype=torch.bool)
                mine = mine.scatter_(-1, torch.where(sel < 0, C, sel).long(), True)[..., :C]   # -1 -> spare
                assert torch.equal(mine, keep), "indexer selection differs from the reference"
            res[mode] = _out_and_grads(a, x)
        _assert_same(a, res, f"layer {lid}")


def case_indexer_replay(g):
    """A C4 attention layer with a replayed selection (`Attention(kept=)`, indexer replay: random visible entries,
    -1 padded, in any order) through the kernels against the reference: output and gradients. Bug caught: the
    kernels' index list given -1 before entries, or unsorted entries the selection lists mishandle."""
    import dataclasses
    from nanoflash.config import preset
    cfg = preset("tiny", index_topk=3)
    S = 29
    x = torch.randn(2, S, cfg.dim, generator=g, requires_grad=True)
    kept = torch.full((2, S, 3), -1)
    for b in range(2):
        for t in range(S):
            pick = torch.randperm((t + 1) // 4, generator=g)[:3]
            kept[b, t, torch.randperm(3, generator=g)[:len(pick)]] = pick     # -1 anywhere among them
    a = _random_attention(1, cfg, g)
    res = {}
    for mode in ("reference", "triton"):
        a.cfg = dataclasses.replace(cfg, kernels=mode)
        res[mode] = _out_and_grads(a, x, kept=kept)
    _assert_same(a, res, "replayed C4 layer")


def case_the_tree_under_test(g):
    """The subprocess imports the nanoflash of this checkout (tests/interp.py puts it first on PYTHONPATH).
    Bug caught (planted: the PYTHONPATH line removed, run from a git worktree): the script's sys.path starts
    at tests/, so the editable install's checkout was imported and every case above tested that one."""
    import os
    import nanoflash
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    got = os.path.dirname(os.path.dirname(os.path.abspath(nanoflash.__file__)))
    assert got == root, f"the interpreter cases import nanoflash from {got}, not from this tree {root}"


CASES = {n: f for n, f in dict(globals()).items() if n.startswith("case_")}


# ------------------------------------------------------------------------------------------ pytest side
@pytest.fixture(scope="module")
def interpreted():
    """Every case once in a subprocess under TRITON_INTERPRET=1 (tests/interp.py); -> {case: "ok" | traceback}"""
    return interp.interpreted(__file__, INTERP_TIMEOUT_S)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_under_interpreter(interpreted, case):
    assert interpreted.get(case) == "ok", interpreted.get(case, "case did not run")


def test_topk_lower_index_wins_matches_stable_sort(gen):
    """Ties (ReLU zeros, +0.0 vs -0.0, repeated values) go to the lower entry index, as the stable sort's."""
    from nanoflash.kernels import topk_lower_index_wins
    B, S, C, k = 2, 17, 12, 5
    score = torch.randint(-3, 4, (B, S, C), generator=gen).float() * 0.5          # many exact ties
    score[0, 0] = 0.0
    score[0, 1] = torch.tensor([-0.0, 0.0] * (C // 2))
    score[1, :, 7:] = float("-inf")                                                # not visible
    score[1, 2] = float("-inf")                                                    # nothing visible
    sel = topk_lower_index_wins(score, k)
    top = score.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    ref = torch.where(score.gather(-1, top) > float("-inf"), top, -1)
    assert torch.equal(sel.long(), ref), "top-k set or order differs from the stable sort"


def test_selection_lists_match_loops(gen):
    """The key-major entry pass's lists (attention_bwd.selection_lists) against Python loops: which queries
    selected an entry of each block (ascending), the chunk offsets, and each (query, block) word's bits.
    Bugs: an entry's bit at the wrong position or block, a -1 (or past-n_sel) entry counted, a query listed
    twice or out of order, a chunk edge that lets the S-padding in (NaN in dcomp before the clamp)."""
    from nanoflash.kernels.attention_bwd import selection_lists
    B, S, C, K, block, chunk = 2, 23, 70, 9, 16, 8
    sel = random_selection(B, S, C, K, gen).int().sort(-1, descending=True).values   # valid entries first
    n_sel = torch.minimum((sel >= 0).sum(-1, dtype=torch.int32),                      # some cut shorter
                          torch.randint(0, K + 1, (B, S), generator=gen, dtype=torch.int32))
    words, lists, offs = selection_lists(sel, n_sel, C, block, chunk)
    nb = -(-C // block)
    assert words.shape == (B, S, nb) and lists.shape == (B, nb, S) and offs.shape == (B, nb, -(-S // chunk) + 1)
    for b in range(B):
        for kb in range(nb):
            want = [t for t in range(S) if any(u // block == kb for u in sel[b, t, :n_sel[b, t]].tolist())]
            n = len(want)
            assert lists[b, kb, :n].tolist() == want and (lists[b, kb, n:] == S).all(), f"list of block {kb}"
            assert offs[b, kb].tolist() == [sum(t < min(c * chunk, S) for t in want) for c in range(offs.shape[-1])]
        for t in range(S):
            bits = [0] * nb
            for u in sel[b, t, :n_sel[b, t]].tolist():
                bits[u // block] |= 1 << (u % block)
            assert words[b, t].tolist() == bits, f"words of query {t}"


def test_comp_mode_auto_is_key_major_for_dense_selections():
    """auto: key-major for C128's all-visible lists and for C4 at S = 4096 (top-512 of 1024 entries), the
    query-major atomic pass for C4 at S = 8192 (512 of 2048); a misspelt mode is an error, not a default.
    Bug caught: the rule inverted (C128's dense lists on per-pair atomics)."""
    from nanoflash.kernels.attention_bwd import comp_mode
    auto = {"comp_mode": "auto"}
    assert comp_mode(auto, torch.zeros(1, 4096, 32), 32) == "keys"
    assert comp_mode(auto, torch.zeros(1, 4096, 512), 1024) == "keys"
    assert comp_mode(auto, torch.zeros(1, 8192, 512), 2048) == "rows"
    assert comp_mode({"comp_mode": "rows"}, torch.zeros(1, 4096, 32), 32) == "rows"
    with pytest.raises(ValueError, match="comp_mode"):
        comp_mode({"comp_mode": "key"}, torch.zeros(1, 8, 4), 4)


def test_sparse_attention_rejects_bad_input():
    from nanoflash.kernels import sparse_attention
    q, kv, sink = torch.zeros(1, 6, 2, 16), torch.zeros(1, 6, 16), torch.zeros(2)
    comp, sel = torch.zeros(1, 4, 16), torch.full((1, 6, 3), -1)
    bad = [((q, kv[:, :5], sink, 1.0, 4), "kv"), ((q, kv, torch.zeros(3), 1.0, 4), "sink"),
           ((q, kv, sink, 1.0, 0), "window"), ((q, kv, sink, 1.0, 4, comp), "both or neither"),
           ((q, kv, sink, 1.0, 4, comp, sel.float()), "integer"),
           ((q, kv, sink, 1.0, 4, comp, torch.full((1, 6, 3), 4)), "entries < comp.shape"),
           ((q, kv, sink, 1.0, 4, comp, torch.tensor([[[1, 2, 1]] * 6])), "duplicates"),
           ((q, kv.double(), sink, 1.0, 4), "one dtype")]
    for args, culprit in bad:
        with pytest.raises(ValueError, match=culprit):
            sparse_attention(*args)


def test_config_kernels_switch():
    """One field picks the path; official / HF configs (no such key) load with the default."""
    from nanoflash.config import ModelConfig, preset
    from nanoflash.model import LayerCache, use_kernels
    with pytest.raises(ValueError, match="kernels"):
        preset("tiny", kernels="fast")
    cfg = preset("tiny")
    assert cfg.kernels == "auto" and ModelConfig.from_dict({"dim": 64}).kernels == "auto"
    assert ModelConfig.from_dict(cfg.to_hf_dict()["nanoflash"]) == cfg
    x = torch.zeros(1, 2, 4)
    assert not use_kernels(cfg, x, None), "auto on CPU keeps the reference"
    assert use_kernels(preset("tiny", kernels="triton"), x, None)
    assert not use_kernels(preset("tiny", kernels="triton"), x, LayerCache()), "decode keeps the reference"
    assert not use_kernels(preset("tiny", kernels="reference"), x, None)


if __name__ == "__main__":
    interp.run_cases(CASES, sys.argv[1])


def test_the_backward_default_is_wgmma_on_hopper_only(monkeypatch):
    """Bugs caught: the wgmma passes (208-224 KiB of shared memory) chosen on an A100 (164 KiB) or the CPU
    interpreter; a config the bench or a test sets not winning over the target's default."""
    from triton.backends.compiler import GPUTarget
    from nanoflash.kernels import attention as ka
    monkeypatch.setattr(ka, "BWD_CONFIG", None)
    assert ka.launch_configs(GPUTarget("cuda", 90, 32))[1] is ka.HOPPER_BWD_CONFIG
    assert ka.HOPPER_BWD_CONFIG["kind"] == "wgmma" and ka.HOPPER_BWD_CONFIG["comp"]["comp_mode"] == "rows"
    assert ka.launch_configs(GPUTarget("cuda", 80, 32))[1] is ka.FUSED_BWD_CONFIG
    assert ka.launch_configs(None)[1] is ka.FUSED_BWD_CONFIG
    mine = dict(ka.FUSED_BWD_CONFIG)
    monkeypatch.setattr(ka, "BWD_CONFIG", mine)
    assert ka.launch_configs(GPUTarget("cuda", 90, 32))[1] is mine
