"""Every block of nanoflash/model.py against the naive references of tests/reference.py, forward and backward,
plus the property tests of v4_notes §4.2-4.3, §5."""
import math

import pytest
import torch

import reference as ref
from nanoflash.config import preset
from nanoflash.model import (Attention, Block, Compressor, Expert, Gate, Indexer, LayerCache, LocalDispatcher, MoE, MTPBlock,
                             RMSNorm, Transformer, apply_rope, hc_head, hc_post, hc_split_sinkhorn, rope_angles,
                             rope_inv_freq)

# fp32 module vs float64 reference: a few hundred fp32 roundings, relative to max(1, the reference's largest
# |value|) -- MoE outputs reach ~80 with these weights, where 2e-5 absolute would be 2 ulps (measured worst over
# 60 seeds: 5e-7 relative, 4 ulps).
FWD_TOL = 2e-5
# Gradients accumulate more roundings (sums over tokens and heads) than the forward; same relative form.
GRAD_TOL = 1e-4
COTANGENT_SEED = 12345  # the random cotangent of every backward check
# Exact-up-to-rounding identities in fp32 (rope then inverse rope, hc_post vs its float64 loop): measured
# worst 1.4 ulps of the values' scale over 300 seeds; 8 ulps of that scale (an absolute 1e-6 was 1.4 ulps
# of |x| ~ 5 away from failing).
ROUNDING_ULPS = 8
EPS32 = torch.finfo(torch.float32).eps


def cfg_(**kw):
    return preset("tiny", **kw)


def randomize(module, seed=0, std=0.3):
    """Random everything (incl. sinks, ape, biases, hc bases) so no branch is degenerate."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 if n.endswith(("_base", "ape", "attn_sink")) else std))
            if n.endswith("norm.weight"):
                p.add_(1.0)
    return module


def grads(module, out, x):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(COTANGENT_SEED))
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.autograd.grad((out * g).sum(), [x] + params, allow_unused=True), g


def assert_close(a, b, tol, what):
    err = (a.double() - b.double()).abs().max().item()
    assert err <= tol, f"{what}: max |diff| {err:.3e} > {tol:.1e}"


def scaled(tol, ref):
    """An absolute tolerance for values of the reference's scale (never tighter than `tol` itself)."""
    return tol * max(1.0, ref.detach().abs().max().item())


def check_fwd_bwd(module, ours, theirs, x, what):
    """Compare outputs, then d(out.g)/d(x, params) for a random cotangent g."""
    out, want = ours(), theirs()
    assert_close(out, want, scaled(FWD_TOL, want), f"{what} forward")
    (gx, *gp), g = grads(module, out, x)
    ref_out = theirs()
    ref_grads = torch.autograd.grad((ref_out * g.double()).sum(), [x] + [p for p in module.parameters()],
                                    allow_unused=True)
    for (name, _), a, b in zip([("x", None)] + list(module.named_parameters()), [gx] + gp, ref_grads):
        if a is None or b is None:
            assert (a is None or a.abs().max() == 0) and (b is None or b.abs().max() == 0), f"{what} grad {name}"
            continue
        assert_close(a, b, scaled(GRAD_TOL, b), f"{what} grad {name}")


# ------------------------------------------------------------------------------------------------ norms, rope
def test_rmsnorm_matches_reference(gen):
    n = randomize(RMSNorm(16))
    x = torch.randn(3, 5, 16, requires_grad=True, generator=gen)
    check_fwd_bwd(n, lambda: n(x), lambda: ref.rmsnorm(x.double(), n.weight, 1e-6), x, "RMSNorm")


def test_rope_yarn_inv_freq_matches_spec():
    cfg = preset("flash")
    inv = rope_inv_freq(64, cfg.compress_rope_theta, cfg.rope_factor, cfg.original_seq_len, 32, 1)
    base = 1.0 / cfg.compress_rope_theta ** (torch.arange(0, 64, 2) / 64)
    assert torch.allclose(inv[:16], base[:16]), "dims i <= low=15 must keep their frequency"
    assert torch.allclose(inv[25:], base[25:] / 16), "dims i >= high=25 must be divided by the factor"
    assert torch.allclose(inv.double(), ref.layer_inv_freq(cfg, True), rtol=1e-6)
    plain = rope_inv_freq(64, 10000.0, 1.0, 0, 0, 0)
    assert torch.allclose(plain.double(), ref.layer_inv_freq(cfg, False), rtol=1e-6), "sliding layers: no YaRN"


def test_rope_matches_reference_and_inverts(gen):
    cfg = cfg_()
    x = torch.randn(2, 7, 3, cfg.head_dim, generator=gen)
    pos = torch.arange(5, 12)
    for compressed in (False, True):
        cos, sin = rope_angles(cfg, compressed, pos)
        y = apply_rope(x, cos, sin)
        assert_close(y, ref.rope(x.double(), pos, ref.layer_inv_freq(cfg, compressed)), FWD_TOL, "rope")
        assert torch.equal(y[..., :-cfg.rope_head_dim], x[..., :-cfg.rope_head_dim]), "nope dims untouched"
        assert_close(apply_rope(y, cos, sin, inverse=True), x, ROUNDING_ULPS * EPS32 * x.abs().max().item(),
                     "inverse rope")


def test_linear_matches_reference(gen):
    """y = x W^T; with qat_input the input is first FP8-rounded per 1x128 block (pow2 scale, e4m3)."""
    from nanoflash.model import Linear
    from nanoflash.quant import fp8_sim
    lin = randomize(Linear(256, 24))
    x = torch.randn(3, 256, requires_grad=True, generator=gen)
    check_fwd_bwd(lin, lambda: lin(x), lambda: x.double() @ lin.weight.double().T, x, "Linear")
    q = Linear(256, 24, qat_input=True)
    q.load_state_dict(lin.state_dict())
    xs = x.detach()
    blocks = xs.view(3, 2, 128)
    scale = 2.0 ** torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448))
    want = ((blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).view(3, 256)
    assert torch.equal(fp8_sim(xs, 128), want), "official act_quant rounding"
    assert_close(q(xs), want.double() @ lin.weight.double().T, FWD_TOL, "Linear with FP8 input QAT")


# ------------------------------------------------------------------------------------------------ compressor
@pytest.mark.parametrize("ratio", [4, 8])
def test_compressor_matches_reference(ratio, gen):
    cfg = cfg_()
    c = randomize(Compressor(cfg, ratio, cfg.head_dim))
    x = torch.randn(2, 27, cfg.dim, requires_grad=True, generator=gen)
    check_fwd_bwd(c, lambda: c(x, 0)[0], lambda: ref.compressor(c, x, cfg), x, f"Compressor m={ratio}")


# Streamed vs one-pass compressor: the same fp32 math on differently shaped matmuls (other blocking, other
# summation order), then RMSNorm and RoPE. Measured worst case over 200 seeds: 8 ulps of the output scale;
# 32 ulps leaves 4x headroom, while a wrong window state or offset moves entries by O(1).
STREAM_ULPS = 32


@pytest.mark.parametrize("ratio", [4, 8])
def test_compressor_property_entries_and_streaming(ratio, gen):
    """S//m entries; feeding the tokens in pieces (decode) gives the same entries as one pass."""
    cfg = cfg_()
    c = randomize(Compressor(cfg, ratio, cfg.head_dim))
    x = torch.randn(2, 29, cfg.dim, generator=gen)
    full, _ = c(x, 0)
    assert full.shape[1] == 29 // ratio
    parts, state, pos = [], None, 0
    for n in (5, 1, 1, 9, 1, 12):
        out, state = c(x[:, pos:pos + n], pos, state)
        parts.append(out)
        pos += n
    tol = STREAM_ULPS * torch.finfo(torch.float32).eps * full.abs().max().item()
    assert_close(torch.cat(parts, 1), full, tol, "streamed compressor")


# ------------------------------------------------------------------------------------------------ indexer
def test_indexer_matches_reference(gen):
    cfg = cfg_(index_topk=3)
    idx = randomize(Indexer(cfg))
    x, qr = torch.randn(2, 26, cfg.dim, generator=gen), torch.randn(2, 26, cfg.q_lora_rank, generator=gen)
    keep, keys, _ = idx(x, qr, 0, None)
    scores = ref.indexer_scores(idx, x, qr, cfg)
    for b in range(2):
        for t in range(26):
            vis = torch.isfinite(scores[b, t])
            kept, dropped = scores[b, t][keep[b, t]], scores[b, t][vis & ~keep[b, t]]
            assert len(kept) == min(3, int(vis.sum())) and not (keep[b, t] & ~vis).any(), f"b={b} t={t}"
            if len(kept) and len(dropped):   # a top-k set: ties (ReLU zeros) may break either way
                assert kept.min() >= dropped.max() - FWD_TOL, f"b={b} t={t}: not the top-k"


def test_indexer_property_visibility_and_count(gen):
    """Query t keeps exactly min(topk, (t+1)//4) entries, all with w < (t+1)//4 (the official -1 padding)."""
    cfg = cfg_(index_topk=3)
    idx = randomize(Indexer(cfg))
    keep, _, _ = idx(torch.randn(1, 30, cfg.dim, generator=gen), torch.randn(1, 30, cfg.q_lora_rank, generator=gen), 0, None)
    for t in range(30):
        vis = (t + 1) // 4
        assert keep[0, t].sum() == min(3, vis), f"t={t}"
        assert not keep[0, t, vis:].any(), f"t={t} keeps an entry of an incomplete window"


# ------------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("layer_id,topk", [(0, 3), (1, 3), (1, 64), (2, 3)])  # sliding, C4 sparse/all, ratio 8
def test_attention_matches_reference(layer_id, topk, gen):
    cfg = cfg_(index_topk=topk)
    a = randomize(Attention(layer_id, cfg), seed=layer_id)
    x = torch.randn(2, 21, cfg.dim, requires_grad=True, generator=gen)
    keep = None
    if layer_id == 1 and topk < 21 // 4:
        keep = a.compressed_keys(x, a.q_norm(a.wq_a(x)), 0, LayerCache())[1].detach()
        assert (keep.sum(-1) < torch.arange(1, 22) // 4).any(), "the selection must actually drop entries"
    check_fwd_bwd(a, lambda: a(x), lambda: ref.attention(a, x, cfg, keep), x, f"Attention layer {layer_id}")


def test_attention_chunking_does_not_change_result(gen):
    cfg = cfg_()
    a = randomize(Attention(1, cfg))
    x = torch.randn(2, 33, cfg.dim, generator=gen)
    whole = a(x)
    a.cfg = cfg_(attn_chunk=5)
    assert_close(a(x), whole, 1e-6 * whole.abs().max().item(), "chunked attention (fp32 ulps of the output scale)")


@pytest.mark.parametrize("layer_id", [0, 1, 2])
def test_attention_property_causal_and_window(layer_id, gen):
    cfg = cfg_()
    a = randomize(Attention(layer_id, cfg))
    x = torch.randn(1, 30, cfg.dim, generator=gen)
    y = a(x)
    x2 = x.clone()
    x2[:, 20] += 1.0
    y2 = a(x2)
    assert torch.equal(y[:, :20], y2[:, :20]), "a later token changed an earlier output"
    if layer_id == 0:   # sliding only: token 20 is outside the window [t-W+1, t] of t >= 20+W
        assert torch.equal(y[:, 20 + cfg.window_size:], y2[:, 20 + cfg.window_size:]), "window leaks"
        assert not torch.equal(y[:, 20 + cfg.window_size - 1], y2[:, 20 + cfg.window_size - 1]), "window too short"


def test_attention_property_compressed_visibility(gen):
    """Entry w is visible to t iff w < (t+1)//m: for m=8, query 14 sees entry 0 only, query 15 sees entry 1."""
    cfg = cfg_()
    a = randomize(Attention(2, cfg))
    _, keep = a.compressed_keys(torch.randn(1, 16, cfg.dim, generator=gen), torch.randn(1, 16, cfg.q_lora_rank, generator=gen), 0, LayerCache())
    assert keep[0, 14].tolist() == [True, False] and keep[0, 15].tolist() == [True, True]
    assert not keep[0, :7].any() and keep[0, 7, 0]


# ------------------------------------------------------------------------------------------------ MoE
def test_gate_matches_reference(gen):
    cfg = cfg_()
    for layer_id in (0, 3):                                   # hash layer, score layer
        g = randomize(Gate(layer_id, cfg))
        if g.hash:
            g.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, g.tid2eid.shape, generator=gen))
        x, ids = torch.randn(11, cfg.dim, generator=gen), torch.randint(0, cfg.vocab_size, (11,), generator=gen)
        w, idx = g(x, ids)
        rw, ridx = ref.gate(g, x, ids, cfg)
        assert torch.equal(idx.sort(-1).values, ridx.sort(-1).values), f"layer {layer_id} experts"
        order = lambda i: i.argsort(-1)
        assert_close(w.gather(1, order(idx)), rw.gather(1, order(ridx)), FWD_TOL, "gate weights")


def test_gate_property_hash_ignores_bias_and_follows_table(gen):
    cfg = cfg_()
    g = randomize(Gate(0, cfg))
    assert g.hash and not hasattr(g, "bias"), "hash layers have no selection bias"
    g.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, g.tid2eid.shape, generator=gen))
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=gen)
    for scale in (0.0, 100.0):                                 # logits do not change the choice
        _, idx = g(torch.randn(9, cfg.dim, generator=gen) * scale, ids)
        assert torch.equal(idx, g.tid2eid[ids])
    assert "tid2eid" in dict(g.named_buffers()) and "tid2eid" in g.state_dict(), "tid2eid must checkpoint"
    s = Gate(cfg.n_hash_layers, cfg)                           # first score layer
    assert not s.hash and s.bias.shape == (cfg.n_routed_experts,)
    assert not MTPBlock(cfg.n_layers, cfg).ffn.gate.hash, "the MTP layer is never hash-routed"


def test_expert_matches_reference_clamp_and_weight_placement(gen):
    cfg = cfg_()
    e = randomize(Expert(cfg.dim, cfg.moe_inter_dim, swiglu_limit=0.5), std=1.0)   # clamp active
    x, rw = torch.randn(7, cfg.dim, requires_grad=True, generator=gen), torch.rand(7, 1, generator=gen)
    check_fwd_bwd(e, lambda: e(x, rw), lambda: ref.expert(e, x, rw.double(), 0.5), x, "Expert")
    shared = randomize(Expert(cfg.dim, cfg.moe_inter_dim, swiglu_limit=0.0), std=1.0)
    want = ref.expert(shared, x)
    assert want.abs().max() > 10 * 0.5, "inputs large enough that a clamp would show"
    assert_close(shared(x), want, 1e-6 * want.abs().max().item(), "shared expert has no clamp")


def test_localdispatcher_matches_reference(gen):
    d = LocalDispatcher(list(range(5)))
    x, idx, w = torch.randn(6, 4, generator=gen), torch.randint(0, 5, (6, 2), generator=gen), torch.rand(6, 2, generator=gen)
    xs, ws, counts, ctx = d.dispatch(x, idx, w)
    assert counts.tolist() == [int((idx == e).sum()) for e in range(5)]   # counts stay on the device
    expert_of_slot = torch.repeat_interleave(torch.arange(5), counts)
    y = d.combine(xs * ws * (expert_of_slot[:, None] + 1), ctx)      # each slot scaled by (expert + 1)
    want = sum(x * w[:, k:k + 1] * (idx[:, k:k + 1] + 1) for k in range(2))
    assert_close(y, want, 1e-6, "dispatch/combine")


def test_moe_matches_reference(gen):
    cfg = cfg_()
    for layer_id in (0, 3):
        m = randomize(MoE(layer_id, cfg), seed=layer_id)
        if m.gate.hash:
            m.gate.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, m.gate.tid2eid.shape, generator=gen))
        x, ids = torch.randn(2, 5, cfg.dim, requires_grad=True, generator=gen), torch.randint(0, cfg.vocab_size, (2, 5), generator=gen)
        check_fwd_bwd(m, lambda: m(x, ids), lambda: ref.moe(m, x, ids, cfg), x, f"MoE layer {layer_id}")


# ------------------------------------------------------------------------------------------------ mHC
SINKHORN_LONG = 200       # iterations for the doubly-stochastic property (linear convergence)
SINKHORN_COL_TOL = 1e-5   # 4 column sums of fp32 values in [0, 1]: a few ulps
SINKHORN_ROW_TOL = 1e-5   # measured worst 1.1e-6 after 200 iterations (500 seeds)


def test_sinkhorn_matches_reference_and_is_doubly_stochastic(gen):
    M, mixes = 4, torch.randn(6, 24, generator=gen) * 3
    scale, base = torch.tensor([0.7, 1.3, 2.0]), torch.randn(24, generator=gen)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, M, 20, 1e-6)
    rp, rq, rc = ref.sinkhorn(mixes, scale.tolist(), base.tolist(), M, 20, 1e-6)
    assert_close(pre, rp, 1e-6, "pre"), assert_close(post, rq, 1e-6, "post"), assert_close(comb, rc, 1e-6, "comb")
    # Columns are normalised last: exact to fp32 after any number of iterations. Rows converge linearly, at
    # a rate that depends on the logits: after 20 iterations they were off by up to 2e-2 over 500 seeds
    # (so that is no property of the model), after SINKHORN_LONG iterations by at most 1.1e-6.
    mixes, base = torch.randn(6, 24, generator=gen), torch.randn(24, generator=gen)
    _, _, comb = hc_split_sinkhorn(mixes, torch.ones(3), base, M, 20, 1e-6)
    assert_close(comb.sum(-2), torch.ones(6, M), SINKHORN_COL_TOL, "columns sum to 1")
    _, _, comb = hc_split_sinkhorn(mixes, torch.ones(3), base, M, SINKHORN_LONG, 1e-6)
    assert_close(comb.sum(-1), torch.ones(6, M), SINKHORN_ROW_TOL, "rows sum to 1 once converged")


def test_hc_post_property_comb_transposed(gen):
    """out_k = post_k x + sum_j comb[j,k] res_j on a non-symmetric comb (the most common porting bug)."""
    x, res, post = torch.randn(1, 2, 8, generator=gen), torch.randn(1, 2, 3, 8, generator=gen), torch.rand(1, 2, 3, generator=gen)
    comb = torch.rand(1, 2, 3, 3, generator=gen)
    assert not torch.allclose(comb, comb.transpose(-1, -2))
    want = ref.hc_post(x, res, post, comb)
    assert_close(hc_post(x, res, post, comb), want, ROUNDING_ULPS * EPS32 * want.abs().max().item(), "hc_post")
    wrong = ref.hc_post(x, res, post, comb.transpose(-1, -2))
    assert (hc_post(x, res, post, comb) - wrong).abs().max() > 1e-2, "orientation must matter"


def test_hc_property_stream_sum_preserved(gen):
    """With the sublayer output zeroed, a doubly stochastic comb preserves the sum over streams."""
    cfg = cfg_()
    b = randomize(Block(3, cfg))
    h = torch.randn(2, 5, cfg.hc_mult, cfg.dim, generator=gen)
    _, post, comb = b.hc_pre(h, b.hc_attn_fn, b.hc_attn_scale, b.hc_attn_base)
    out = hc_post(torch.zeros(2, 5, cfg.dim), h, post, comb)
    assert_close(out.sum(2), h.sum(2), 1e-3 * h.abs().max().item(), "stream sum")


def test_block_matches_reference(gen):
    """Full Block: mHC pre/post around the attention and MoE references."""
    cfg = cfg_()
    b = randomize(Block(1, cfg), std=0.2)
    h, ids = torch.randn(1, 10, cfg.hc_mult, cfg.dim, generator=gen), torch.randint(0, cfg.vocab_size, (1, 10), generator=gen)

    def reference():
        x = h
        for fn, sc, bs, sub, norm in ((b.hc_attn_fn, b.hc_attn_scale, b.hc_attn_base, "attn", b.attn_norm),
                                      (b.hc_ffn_fn, b.hc_ffn_scale, b.hc_ffn_base, "ffn", b.ffn_norm)):
            xf = x.flatten(2).double()
            mixes = (xf @ fn.double().T) / torch.sqrt((xf * xf).mean(-1, keepdim=True) + cfg.norm_eps)
            pre, post, comb = ref.sinkhorn(mixes.flatten(0, 1), sc.tolist(), bs.tolist(), cfg.hc_mult,
                                           cfg.hc_sinkhorn_iters, cfg.hc_eps)
            pre, post, comb = (t.view(*x.shape[:2], *t.shape[1:]) for t in (pre, post, comb))
            y = ref.rmsnorm((pre[..., None] * x.double()).sum(2), norm.weight, cfg.norm_eps).float()
            y = ref.attention(b.attn, y, cfg) if sub == "attn" else ref.moe(b.ffn, y, ids, cfg)
            x = ref.hc_post(y, x, post, comb).float()
        return x

    with torch.no_grad():
        assert_close(b(h, ids), reference(), 1e-4, "Block")


def test_mtpblock_and_hc_head_match_reference(gen):
    cfg = cfg_()
    model = randomize(Transformer(cfg), std=0.2)
    h, nxt = torch.randn(1, 6, cfg.hc_mult, cfg.dim, generator=gen), torch.randint(0, cfg.vocab_size, (1, 6), generator=gen)
    blk = model.mtp["0"]
    with torch.no_grad():
        e = ref.rmsnorm(model.embed.weight[nxt].double(), blk.enorm.weight, cfg.norm_eps)
        x = (e @ blk.e_proj.weight.double().T)[:, :, None] + \
            ref.rmsnorm(h.double(), blk.hnorm.weight, cfg.norm_eps) @ blk.h_proj.weight.double().T
        want = Block.forward(blk, x.float(), nxt)
        assert_close(blk(h, nxt, model.embed), want, 2e-6 * want.abs().max().item(), "MTP input projection")
        xf = h.flatten(2).double()
        mixes = (xf @ model.hc_head_fn.double().T) / torch.sqrt((xf * xf).mean(-1, keepdim=True) + cfg.norm_eps)
        pre = torch.sigmoid(mixes * model.hc_head_scale.double() + model.hc_head_base.double()) + cfg.hc_eps
        want = (pre[..., None] * h.double()).sum(2)
        got = hc_head(h, model.hc_head_fn, model.hc_head_scale, model.hc_head_base, cfg)
        assert_close(got, want, 1e-5, "hc_head")
