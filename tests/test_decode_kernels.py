"""The decode seam (`model.decode_kernels`): a cached forward's few-launch paths against the readable reference.

* `RoutedExperts.dense` (every expert on every token, batched GEMMs) against the per-expert loop of
  `MoE.forward` (dispatch -> `expert_ffn` per expert -> combine), fp32 and with QAT, on the CPU;
* the switch: which forwards take it (a cache; "auto" on CUDA, "triton" anywhere, "reference" never; dense
  experts only on one-token steps and where `dense_pays`);
* the one-token step's kernels (`nanoflash.kernels.decode`) against the functions they replace: `rms_rope`
  against `RMSNorm` / q's per-head RMS then `apply_rope` (fp32 and bf16), `decode_attention` against
  `Attention.attend` (padded windows, kept entries by mask and by position, sliding layers);
* a whole decode (prefill of rows, `cat_caches`, per-row steps; rows leaving and joining) with kernels="triton"
  (fused mHC under Triton's interpreter, dense experts, `Block.decode_step`) against kernels="reference": logits
  and the caches it leaves, with the indexer's top-k both skipped (C <= index_topk) and run; and the engine's
  samples (`RolloutEngine`, fixed seeds) on both paths -- in a subprocess (TRITON_INTERPRET=1 must be set before
  Triton is imported: tests/interp.py).
The GPU checks (`-m gpu`): the step kernels at the `small` geometry here; the whole decode and the engine on the
`gpu` recipe's geometry in `tests/test_rollout_batching.py -m gpu` (both run by bench/gpu_batching.sh).

Run: pytest tests/test_decode_kernels.py -q
"""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import interp  # noqa: E402  tests/interp.py: the kernel cases under Triton's interpreter, in a subprocess

from nanoflash.config import preset  # noqa: E402
from nanoflash.model import (Attention, Compressor, CompressorState, DecodeStep, Indexer, LayerCache, MoE,  # noqa: E402
                             RMSNorm, Transformer, apply_rope, decode_kernels, rope_angles, round_robin_tid2eid,
                             visible_entries)

# Dense vs loop experts, fp32: the same products, summed over 8 experts (zeros included) instead of over the
# top-2 slots, and the GEMMs in other shapes: measured 3e-7 relative to the output's max (tiny, weights ~0.3).
# A routing weight on the wrong expert, a lost clamp or a dropped expert moves outputs by O(1) relative.
DENSE_REL = 1e-5
# Whole decode, fused mHC + dense experts vs the reference (fp32): FMA dots over M*D in another order, exp in
# numpy; logits of order 1 after 4 layers, measured <= 1e-6 relative. A Sinkhorn iteration short, comb applied
# untransposed or a row on another row's routing moves them by > 1e-2.
DECODE_REL = 1e-4
# rms_rope vs RMSNorm / q's RMS then apply_rope, fp32: the same operations, FMA-contracted in the rotation and the
# sum of squares in another order -- measured <= 2.2e-7 of the output's max (20 seeds). The rope's partner, a sign,
# a pair layout or the weight on the wrong element moves it by O(1).
RMS_ROPE_REL = 2e-6
# ... in bf16: fp32 results a last bit apart round to neighbouring bf16 values (one ulp: up to 2^-7 of the max), and
# the reference's q RMS runs in bf16 (square, mean, rsqrt each rounded), the kernel's in fp32 rounded once: measured
# 1.0e-2 (kv), 1.5e-2 (q) of the max over 20 seeds. A wrong element is O(1).
RMS_ROPE_REL_BF16 = 3e-2
# decode_attention vs Attention.attend (fp32): an online softmax in exp2 and FMA dots against softmax + einsum,
# measured <= 3e-7 of the output's max. An unmasked padding column, an invisible entry kept or the sink dropped
# moves it by > 1e-2.
ATTN_REL = 2e-6
# Compressor.decode_step vs step_rows (fp32): an online softmax over the slots (the sum divided once) against
# softmax then a weighted sum, then the same norm + rope: measured <= 2.7e-7 of the max (5 seeds). A slot of the
# wrong window, ape of another slot or a stale prev moves it by O(1).
COMPRESS_REL = 2e-6
INTERP_TIMEOUT_S = 600   # the cases take ~45 s together on the 2-core box (alone); 10x for a loaded CI box


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _moe(cfg, layer_id, gen):
    moe = MoE(layer_id, cfg)
    with torch.no_grad():
        for n, p in moe.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        if moe.gate.hash:                       # Transformer.init_weights' table: K distinct experts per token
            moe.gate.tid2eid.copy_(round_robin_tid2eid(cfg.vocab_size, cfg.n_activated_experts, cfg.n_routed_experts))
    return moe


@pytest.mark.parametrize("qat", [False, True])
@pytest.mark.parametrize("layer_id", [1, 3])          # a hash-routed layer and a score-routed one (tiny)
def test_dense_experts_equal_the_per_expert_loop(gen, qat, layer_id):
    """`MoE.forward(dense=True)` equals the dispatch -> loop -> combine path within DENSE_REL, the clamp of the
    SwiGLU engaged (inputs ~3, weights ~0.3 put |gate| above swiglu_limit=10 for some units). Bugs caught: the routing
    weight scattered to the wrong expert (or onto every expert), w1 / w3 halves swapped, the limit dropped,
    experts summed before w2 without their own weight."""
    cfg = preset("tiny", qat=qat)
    moe = _moe(cfg, layer_id, gen)
    x = 3 * torch.randn(7, 1, cfg.dim, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (7, 1), generator=gen)
    with torch.no_grad():
        want, got = moe(x, ids), moe(x, ids, dense=True)
        gate = moe.experts.w13[:, :cfg.moe_inter_dim] @ x[:, 0].T
    assert bool((gate.abs() > cfg.swiglu_limit).any()), "the clamp is not exercised"
    assert moe.dense_pays() and rel(got, want) <= DENSE_REL, rel(got, want)


def test_dense_experts_sum_a_repeated_expert_twice(gen):
    """A hash table naming one expert twice for a token (a pushed tid2eid may) counts it twice, as the loop does.
    Bug caught: `scatter_` instead of `scatter_add_` (the second weight overwrites the first)."""
    cfg = preset("tiny")
    moe = _moe(cfg, 0, gen)                      # layer 0: hash routing
    moe.gate.tid2eid[:] = 5                      # both slots of every token -> expert 5
    x, ids = torch.randn(4, 1, cfg.dim, generator=gen), torch.randint(0, cfg.vocab_size, (4, 1), generator=gen)
    with torch.no_grad():
        assert rel(moe(x, ids, dense=True), moe(x, ids)) <= DENSE_REL


def test_the_decode_seam_switch():
    """Which forwards take the decode paths. Bugs caught: the seam taken without a cache (training and scoring
    forwards would change), on the CPU under "auto" (CPU behaviour would change), under "reference"; dense
    experts where they cost more than E/K allows (V4-Flash) or on a layer holding a slice of the experts (EP);
    the step path (`DecodeStep.of`) taken for a prefill, one start for all rows, or with autograd on."""
    h = torch.zeros(1, 1, 4, 8)
    for mode, want in (("auto", False), ("triton", True), ("reference", False)):
        cfg = preset("tiny", kernels=mode)
        assert decode_kernels(cfg, h, LayerCache()) is want, mode
        assert not decode_kernels(cfg, h, None), mode
    assert MoE(1, preset("tiny")).dense_pays()
    flash = preset("tiny", n_routed_experts=64, n_activated_experts=6)      # 64 / 6 > DENSE_MAX_FLOPS
    assert not MoE(1, flash).dense_pays()
    ep = MoE(1, preset("tiny"))
    ep.experts.keep(range(4))
    assert not ep.dense_pays()
    # the one-token step path (`Block.decode_step`): per-row positions, one token a row, a cache, autograd off
    tri, pos = preset("tiny", kernels="triton"), torch.tensor([3])
    with torch.no_grad():
        assert DecodeStep.of(tri, h, pos, {}) is not None
        assert DecodeStep.of(preset("tiny", kernels="reference"), h, pos, {}) is None
        assert DecodeStep.of(tri, h, 3, {}) is None and DecodeStep.of(tri, h, pos, None) is None
        assert DecodeStep.of(tri, torch.zeros(1, 2, 4, 8), pos, {}) is None
    assert DecodeStep.of(tri, h, pos, {}) is None            # autograd would record kernels with no backward


# ------------------------------------------------------------------------------------------ interpreter case
def _decode_logits(model, rows, steps):
    """Prefill each row alone, join the caches, then `steps` one-token steps at per-row positions.
    -> [steps + 1, rows, V] (the prefill's last logits, then each step's)"""
    caches, out = [model.new_cache() for _ in rows], []
    out.append(torch.stack([model(r[None], 0, c)[0, -1] for r, c in zip(rows, caches)]))
    cache, pos = model.cat_caches(caches), torch.tensor([len(r) for r in rows])
    for t in range(steps):
        ids = torch.stack([(r[-1:] + 3 * t + 1) % model.cfg.vocab_size for r in rows])       # [B,1]
        out.append(model(ids, pos, cache)[:, -1])
        pos = pos + 1
    return torch.stack(out)


def case_decode_triton_vs_reference(gen):
    """tiny (sliding, C4 with the indexer, ratio 8; hash and score routing), 3 rows at lengths 9, 6, 13 decoding
    6 steps, so windows end at different steps per row: kernels="triton" (fused mHC, dense experts) within
    DECODE_REL of kernels="reference"."""
    cfg = preset("tiny", kernels="reference")
    model = Transformer(cfg).init_weights(0).eval()
    with torch.no_grad():   # mHC coefficients far from uniform (at init comb ~ J/M: a transposed comb would pass)
        for n, p in model.named_parameters():
            if n.endswith(("hc_attn_fn", "hc_ffn_fn", "hc_attn_base", "hc_ffn_base")):
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 if n.endswith("base") else 0.5))
    rows = [torch.randint(0, cfg.vocab_size, (L,), generator=gen) for L in (9, 6, 13)]
    with torch.no_grad():
        want = _decode_logits(model, rows, 6)
        for m in model.modules():                        # every module holds the one config: switch it
            if hasattr(m, "cfg"):
                m.cfg = dataclasses.replace(cfg, kernels="triton")
        got = _decode_logits(model, rows, 6)
    assert rel(got, want) <= DECODE_REL, f"relative error {rel(got, want):.2e}"


def _check_rms_rope(cfg, B: int, H: int, device, gen):
    """rms_rope in each use of `Attention.decode_step` against the functions it replaces, fp32 and bf16 (see
    case_rms_rope_equals_norm_then_rope)."""
    from nanoflash.kernels.decode import rms_rope
    Dh, eps = cfg.head_dim, cfg.norm_eps
    positions = torch.randint(0, 4 * cfg.window_size, (B, 1), generator=gen)
    positions[0] = 0
    cos, sin = rope_angles(cfg, True, positions.to(device))                               # [B,1,R/2]
    norm = RMSNorm(Dh, eps).to(device)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(Dh, generator=gen))
        for dtype, tol in ((torch.float32, RMS_ROPE_REL), (torch.bfloat16, RMS_ROPE_REL_BF16)):
            q, kv, o = (3 * torch.randn(shape, generator=gen) for shape in ((B, 1, H, Dh), (B, 1, Dh), (B, H, Dh)))
            q, kv, o = q.to(device, dtype), kv.to(device, dtype), o.to(device, dtype)
            q_rms = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)              # Attention.query_heads
            pairs = {"kv": (rms_rope(kv, norm.weight, eps, cos, sin), apply_rope(norm(kv), cos, sin)),
                     "q": (rms_rope(q, None, eps, cos, sin), apply_rope(q_rms, cos, sin)),
                     "norm": (rms_rope(kv, norm.weight, eps), norm(kv)),
                     "o": (rms_rope(o, cos=cos, sin=sin, inverse=True, norm=False),
                           apply_rope(o[:, None], cos, sin, inverse=True)[:, 0])}
            for name, (got, want) in pairs.items():
                assert got.dtype == dtype and got.shape == want.shape, (name, got.dtype, got.shape)
                assert rel(got, want) <= tol, f"{name} {dtype}: {rel(got, want):.2e}"


def _check_decode_attention(cfg, B: int, C: int, device, gen):
    """decode_attention against `Attention.attend` (see case_decode_attention_equals_attend)."""
    from nanoflash.kernels.decode import decode_attention
    attn = Attention(1, cfg).to(device)                                  # a C4 layer
    with torch.no_grad():
        attn.attn_sink.copy_(torch.randn(cfg.n_heads, generator=gen))
    W, scale = cfg.window_size, cfg.head_dim ** -0.5
    pos = torch.randint(0, 4 * C, (B,), generator=gen)
    pos[:3] = torch.tensor([0, 2, W - 1])                                # rows shorter than the window
    q = torch.randn(B, 1, cfg.n_heads, cfg.head_dim, generator=gen).to(device)
    comp = torch.randn(B, C, cfg.head_dim, generator=gen).to(device)
    visible = visible_entries(C, pos[:, None], 4).to(device)                             # [B,1,C]
    mask = visible & (torch.rand(B, 1, C, generator=gen) < 0.6).to(device)
    for Lw in (W, 3):
        window = torch.randn(B, Lw, cfg.head_dim, generator=gen).to(device)
        for name, c, keep, ratio, want_keep in (("kept by mask", comp, mask[:, 0], 4, mask),
                                                ("kept by position", comp, None, 4, visible),
                                                ("sliding", None, None, 0, None)):
            with torch.no_grad():
                want = attn.attend(q, pos, window, c, want_keep)[:, 0]                      # [B,H,Dh]
            got = decode_attention(q[:, 0], window, pos.to(device), attn.attn_sink, scale, W, c, keep, ratio)
            assert rel(got, want) <= ATTN_REL, f"{name}, window {Lw}: {rel(got, want):.2e}"


def _check_compressor_step(cfg, B: int, device, gen):
    """Compressor.decode_step (`kernels.decode.compress_step` + the entry's `rms_rope`) against the reference's
    `step_rows` (see case_compressor_step_equals_step_rows)."""
    kinds = [(4, cfg.head_dim, False), (4, cfg.index_head_dim, True)]
    kinds += [(r, cfg.head_dim, False) for r in sorted(set(cfg.compress_ratios) - {0, 4})]
    for ratio, d, rotate in kinds:
        comp = Compressor(cfg, ratio, d, rotate).to(device)
        with torch.no_grad():
            for n, p in comp.named_parameters():
                p.copy_((n == "norm.weight") + 0.5 * torch.randn(p.shape, generator=gen))
        c = comp.ape.shape[1]
        pos = torch.randint(0, 3 * ratio, (B,), generator=gen)
        pos[:2] = torch.tensor([ratio - 1, 2 * ratio - 1])                              # rows whose window ends
        state = CompressorState(*(torch.randn(B, ratio - 1, c, generator=gen).to(device) for _ in range(2)))
        if ratio == 4:                              # a previous window; -inf where a row has none yet
            state.prev_kv = torch.randn(B, ratio, c, generator=gen).to(device)
            state.prev_score = torch.randn(B, ratio, c, generator=gen).to(device)
            state.prev_score[pos < ratio] = float("-inf")
        x = torch.randn(B, 1, cfg.dim, generator=gen).to(device)
        with torch.no_grad():
            want, want_state = comp.step_rows(x, pos, state)
            got, got_state = comp.decode_step(x, DecodeStep(cfg, pos, device), state)
        ends = (pos + 1) % ratio == 0
        assert got.shape == (B, 1, d) and rel(got[ends], want[ends]) <= COMPRESS_REL, (ratio, rotate, "entries")
        for name in ("kv", "score", "prev_kv", "prev_score"):
            a, b = getattr(got_state, name), getattr(want_state, name)
            if b is None:
                assert a is None, (ratio, name)
                continue
            fin = torch.isfinite(b)
            assert a.shape == b.shape and torch.equal(fin, torch.isfinite(a)), (ratio, name)
            assert rel(a[fin], b[fin]) <= COMPRESS_REL, (ratio, rotate, name, rel(a[fin], b[fin]))
        with torch.no_grad():                       # no row's window ends: no entry, prev kept, the state shifted
            pos = torch.tensor([ratio * k for k in range(B)])
            _, want_state = comp.step_rows(x, pos, state)
            got, got_state = comp.decode_step(x, DecodeStep(cfg, pos, device), state)
        assert got is None and got_state.prev_kv is state.prev_kv, (ratio, "no window ends")
        for name in ("kv", "score"):
            a, b = getattr(got_state, name), getattr(want_state, name)
            assert a.shape == b.shape and rel(a, b) <= COMPRESS_REL, (ratio, rotate, name, "no window ends")


def case_compressor_step_equals_step_rows(gen):
    """`Compressor.decode_step` against the reference's `step_rows` for the C4 compressor, the indexer's (rotate)
    and ratio 8, 7 rows at their own positions (two of them ending a window, others not): the entries of the rows
    whose window ends, the shifted state (ape added to the token's score) and C4's previous window (random, -inf
    for rows without one) within COMPRESS_REL; with no window ending, no entry and the same prev. Bugs caught:
    the state not shifted (or shifted the wrong way), ape of another slot, the "Ca" half taken from the current
    window, prev replaced for a row whose window did not end, a -inf previous slot turning the entry into NaN."""
    _check_compressor_step(preset("tiny"), 7, "cpu", gen)


def case_rms_rope_equals_norm_then_rope(gen):
    """`rms_rope` in each use of `Attention.decode_step`: kv (weighted norm + rope), q (per-head RMS + rope, a row's
    angle shared by its H heads), a layer norm (no rope), the output (inverse rope only), fp32 and bf16, rows at
    their own positions, within RMS_ROPE_REL(_BF16) of `RMSNorm` / `query_heads`' RMS then `apply_rope`. Bugs
    caught: the pair partner (i ^ 1) or the rope's sign wrong, the rotation applied to the nope dims or
    half-split instead of interleaved, each head given its own angle row, the inverse not inverted, the weight's
    partner element taken from the wrong index, the norm's eps dropped."""
    _check_rms_rope(preset("tiny"), 5, 3, "cpu", gen)


def case_decode_attention_equals_attend(gen):
    """`decode_attention` against the reference's `Attention.attend` (masks, then `sink_attention`) for 6 rows at
    their own positions -- rows shorter than the window have padding columns, random here, not zeros -- over a
    full window and a short one, with the entries kept by a mask (C4's top-k), by position (C128, and C4 while the
    indexer keeps all) and none (sliding), within ATTN_REL. Bugs caught: the padding unmasked (or real columns
    masked: the window not right-aligned), entries past (p+1)//ratio attended, the keep mask ignored or read from
    another row, the sink left out of the denominator, a head block's output written to another."""
    _check_decode_attention(preset("tiny"), 6, 9, "cpu", gen)


def case_dense_experts_with_the_fused_swiglu(gen):
    """`RoutedExperts.dense` where Triton runs (kernels="triton": the SwiGLU as `kernels.moe.fused_swiglu`) against
    the reference's per-expert loop, the clamp engaged, fp32 and with QAT, within DENSE_REL. Bugs caught: the
    fused SwiGLU handed [N, E, 2I] rows of another layout (gate and up halves of different experts), the routing
    weights flattened in another order than the rows."""
    for qat in (False, True):
        cfg = preset("tiny", qat=qat, kernels="reference")
        moe = _moe(cfg, 3, gen)
        x = 3 * torch.randn(7, 1, cfg.dim, generator=gen)
        ids = torch.randint(0, cfg.vocab_size, (7, 1), generator=gen)
        with torch.no_grad():
            want = moe(x, ids)
            _set_kernels(moe, "triton")
            got = moe(x, ids, dense=True)
        assert rel(got, want) <= DENSE_REL, f"qat={qat}: {rel(got, want):.2e}"


def _set_kernels(model, mode: str):
    cfg = dataclasses.replace(next(m.cfg for m in model.modules() if hasattr(m, "cfg")), kernels=mode)
    for m in model.modules():                        # every module holds the one config: switch it
        if hasattr(m, "cfg"):
            m.cfg = cfg


def _draw_zero_init(model, gen):
    """Draw the parameters `init_weights` leaves at 0 or 1 (norm weights, ape, sinks, gate biases): at init a
    norm weight read at the wrong element or an `ape` row of the wrong slot would change nothing."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif n.endswith(("ape", "attn_sink", "gate.bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def _decode_join_leave(model, gen_seed: int, before: int, after: int):
    """The engine's life of a decode batch: rows of lengths 9, 6, 13 prefilled alone and joined, `before` per-row
    steps, the middle row leaving (`cache_rows`) and a row of length 5 joining (`cat_caches`), `after` more steps.
    -> (logits [before + after, rows, V] of the steps, the final cache)"""
    g = torch.Generator().manual_seed(gen_seed)
    V = model.cfg.vocab_size
    rows = [torch.randint(0, V, (L,), generator=g) for L in (9, 6, 13)]
    caches = [model.new_cache() for _ in rows]
    for r, c in zip(rows, caches):
        model(r[None], 0, c)
    cache, pos, out = model.cat_caches(caches), torch.tensor([len(r) for r in rows]), []
    for t in range(before + after):
        if t == before:
            late, joiner = torch.randint(0, V, (1, 5), generator=g), model.new_cache()
            model(late, 0, joiner)
            cache = model.cat_caches([model.cache_rows(cache, torch.tensor([0, 2])), joiner])
            pos = torch.cat([pos[[0, 2]], torch.tensor([5])])
        ids = torch.randint(0, V, (len(pos), 1), generator=g)
        out.append(model(ids, pos, cache)[:, -1])
        pos = pos + 1
    return torch.stack(out), cache


def case_decode_steps_with_rows_leaving_and_joining(gen):
    """The step path (`Block.decode_step`) through an engine's batch life (`_decode_join_leave`: 4 steps, a row
    leaves and one joins, 6 more), for tiny with index_topk 4 (the indexer's top-k skipped while C <= 4) and
    index_topk 1 with QAT (FP8 / FP4 simulation of kv, entries and keys): the logits and every tensor of the
    cache it leaves within DECODE_REL of kernels="reference". The path must run on every step (a DecodeStep
    built), the top-k on some steps of the first config and on every step of the second. Bugs caught: a
    compressor state or entry written for a row whose window did not end, the C4 "Ca" window not carried per
    row, entries appended in the wrong slot, the cache's window not cut to W-1 (each shows in the caches before
    the logits), the top-k skipped when the batch holds more entries than index_topk, the `ape` row of the
    slot after the token's."""
    built, real, top_k, real_top = [0], DecodeStep.__init__, [0], Indexer.top_k

    def counted(self, *a, **k):
        built[0] += 1
        real(self, *a, **k)

    def counted_top(self, q, keys, w, start_pos):
        top_k[0] += torch.is_tensor(start_pos)           # in a decode step (a prefill's start is an int)
        return real_top(self, q, keys, w, start_pos)
    DecodeStep.__init__, Indexer.top_k = counted, counted_top
    try:
        for over in ({}, {"index_topk": 1, "qat": True}):
            model = Transformer(preset("tiny", kernels="reference", **over)).init_weights(0).eval()
            _draw_zero_init(model, gen)
            with torch.no_grad():
                want, want_cache = _decode_join_leave(model, 7, 4, 6)
                _set_kernels(model, "triton")
                built[0] = top_k[0] = 0
                got, got_cache = _decode_join_leave(model, 7, 4, 6)
            assert built[0] == 10, f"{over}: the step path ran on {built[0]} of 10 steps"
            # 2 C4 layers x 10 steps; index_topk 4: skipped until a row's 5th entry (step 6), then run
            assert 0 < top_k[0] < 20 if not over else top_k[0] == 20, f"{over}: the top-k ran {top_k[0]} times"
            assert rel(got, want) <= DECODE_REL, f"{over}: logits {rel(got, want):.2e}"
            for key, lc in want_cache.items():
                for f in dataclasses.fields(LayerCache):
                    a, b = getattr(got_cache[key], f.name), getattr(lc, f.name)
                    if f.name.endswith("state") and b is not None:
                        pairs = [(getattr(a, n), getattr(b, n)) for n in ("kv", "score", "prev_kv", "prev_score")]
                    else:
                        pairs = [(a, b)]
                    for x, y in pairs:
                        if y is None:
                            assert x is None, (over, key, f.name)
                            continue
                        fin = torch.isfinite(y)                        # prev_score starts at -inf
                        assert x.shape == y.shape and torch.equal(fin, torch.isfinite(x)), (over, key, f.name)
                        assert not fin.any() or rel(x[fin], y[fin]) <= DECODE_REL, (over, key, f.name)
    finally:
        DecodeStep.__init__, Indexer.top_k = real, real_top


def case_engine_samples_the_same_tokens_on_the_decode_seam(gen):
    """`RolloutEngine` (fp32 weights, continuous batching) on tiny with kernels="triton" (the decode seam, each
    step `Block.decode_step`) against kernels="reference": two requests x 3 samples x 8 tokens at fixed seeds
    give the same tokens (their log-probs, from the scoring forward, then agree too). Bug caught: a step path
    that passes the logits check's tolerance but not the sampler's (a row's logits swapped with another's, a
    stale cache after the engine drops rows)."""
    from nanoflash.server.engine import RolloutEngine, parse_sampling
    out = {}
    for mode in ("reference", "triton"):
        model = Transformer(preset("tiny", kernels=mode)).init_weights(0)
        engine = RolloutEngine(model, weights="fp32")
        assert engine.use_cache, mode
        out[mode] = []
        for i, prompt in enumerate(([3, 17, 42, 9, 11], [5, 9, 2, 100, 7, 8, 9, 10, 11, 12, 13])):
            sp = parse_sampling({"n": 3, "temperature": 1.0, "max_new_tokens": 8, "stop_token_ids": [],
                                 "sampling_seed": 10 + i}, 256)
            out[mode] += [(r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]])
                          for r in engine.generate(prompt, sp)]
    for (ids_r, lp_r), (ids_t, lp_t) in zip(out["reference"], out["triton"]):
        assert ids_t == ids_r, (ids_t, ids_r)
        assert rel(torch.tensor(lp_t), torch.tensor(lp_r)) <= DECODE_REL, (lp_t, lp_r)


CASES = {n: f for n, f in dict(globals()).items() if n.startswith("case_")}


@pytest.mark.gpu
def test_step_kernels_on_the_gpu(gen):
    """The step kernels compiled for the GPU at the `small` geometry (64 rows, 64 heads x 512, rope 64, window
    128, 40 entries, C4 / C128 compressors of 512 and the indexer's of 128) against the same references on CUDA:
    `rms_rope` fp32 and bf16, `decode_attention` fp32, `Compressor.decode_step` (case_rms_rope_equals_norm_then_rope,
    case_decode_attention_equals_attend, case_compressor_step_equals_step_rows). Bugs caught: a kernel right
    only at the interpreter's sizes (head blocks, a key loop of several blocks, a head dim of 512 with rope at
    its end) or in numpy's arithmetic."""
    cfg = preset("small")
    _check_rms_rope(cfg, 64, cfg.n_heads, "cuda", gen)
    _check_decode_attention(cfg, 64, 40, "cuda", gen)
    _check_compressor_step(cfg, 64, "cuda", gen)


@pytest.fixture(scope="module")
def interpreted():
    return interp.interpreted(__file__, INTERP_TIMEOUT_S)


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_under_interpreter(interpreted, case):
    """Bugs caught: see each case's docstring (the fused mHC or the dense experts wrong inside a decode)."""
    assert interpreted.get(case) == "ok", interpreted.get(case, "case did not run")


if __name__ == "__main__":   # the subprocess side (TRITON_INTERPRET=1)
    interp.run_cases(CASES, sys.argv[1])
