"""Whole-model tests: published parameter counts on meta, decode == full forward, token_logprobs, QAT switch,
recomputation, and the style lint of model.py (every class documents its equation and shapes)."""
import ast
import pathlib

import pytest
import torch
import torch.nn.functional as F

from nanoflash.config import preset
from nanoflash.model import RoutedExperts, Transformer
from nanoflash.quant import hadamard

# Decode and prefill take different reduction orders (chunked softmax, concatenated caches): fp32 ulps,
# relative to the logit scale.
DECODE_TOL = 1e-5


def tiny_model(seed=0, **kw):
    m = Transformer(preset("tiny", **kw)).init_weights(seed, std=0.2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # non-degenerate sinks, ape, hc bases and router biases
        for n, p in m.named_parameters():
            if n.endswith(("_base", "attn_sink", "ape", "gate.bias")):
                p.copy_(torch.randn(p.shape, generator=g))
    return m


def count(model, with_mtp=True, active=False):
    cfg, total = model.cfg, 0
    for name, p in model.named_parameters():
        if not with_mtp and name.startswith("mtp."):
            continue
        total += p.numel()
    if active:
        n_layers = cfg.n_layers + (cfg.n_mtp_layers if with_mtp else 0)
        total -= n_layers * (cfg.n_routed_experts - cfg.n_activated_experts) * 3 * cfg.dim * cfg.moe_inter_dim
    return total


def test_flash_param_count_on_meta():
    with torch.device("meta"):
        m = Transformer(preset("flash"))
    assert count(m) == 290_942_289_362
    assert count(m, with_mtp=False) == 284_332_240_471
    assert count(m, active=True) == 14_118_225_362
    assert count(m, with_mtp=False, active=True) == 13_799_632_471
    hash_tables = [n for n, _ in m.named_buffers() if n.endswith("tid2eid")]
    assert hash_tables == [f"layers.{i}.ffn.gate.tid2eid" for i in range(3)], "tid2eid on the 3 hash layers only"


def test_small_preset_fits_one_h200_and_is_sglang_shaped():
    with torch.device("meta"):
        m = Transformer(preset("small"))
    n = count(m)
    assert 1e9 < n < 3.2e9, f"small preset has {n / 1e9:.2f}B params"
    for name, p in m.named_parameters():   # every 2-D matmul weight is a multiple of the FP8 block
        if p.dim() == 2 and name.endswith("weight") and "embed" not in name and "head" not in name:
            assert p.shape[0] % 128 == 0 or p.shape[0] <= 64 and "weights_proj" in name or "gate" in name, name


def test_full_forward_equals_prefill_plus_decode(gen):
    """Across the window ring wrap (W=8), C4 overlap boundaries and ratio-8 boundaries, and the MTP-free path."""
    m = tiny_model(index_topk=64).eval()
    ids = torch.randint(0, m.cfg.vocab_size, (2, 29), generator=gen)   # W=8 wraps 3x; C4 entries 0..6; ratio-8 entries 0..2
    with torch.no_grad():
        full = m(ids)
        for split in (1, 17):
            cache = m.new_cache()
            parts = [m(ids[:, :split], 0, cache)]
            for t in range(split, 29):
                parts.append(m(ids[:, t:t + 1], t, cache))
            err = (torch.cat(parts, 1) - full).abs().max().item()
            assert err <= DECODE_TOL * full.abs().max().item(), f"prefill {split} + decode: max |diff| {err:.2e}"


def test_decode_with_sparse_indexer_selection(gen):
    """With index_topk < #entries the decode path must select the same entries as the full forward."""
    m = tiny_model(index_topk=2).eval()
    ids = torch.randint(0, m.cfg.vocab_size, (1, 30), generator=gen)
    with torch.no_grad():
        full, cache = m(ids), m.new_cache()
        parts = [m(ids[:, :7], 0, cache)] + [m(ids[:, t:t + 1], t, cache) for t in range(7, 30)]
    assert (torch.cat(parts, 1) - full).abs().max().item() <= DECODE_TOL * full.abs().max().item()


@pytest.mark.usefixtures("one_thread")   # tiny forwards: two threads on the loaded 2-core box spin (0.7 s vs 9-55 s)
def test_decode_rows_at_their_own_positions_equal_the_full_forward(gen):
    """The continuous-batching path (server/engine.py): sequences prefilled alone at different lengths, joined
    (`cat_caches`), decoded together with per-row start_pos, one leaving (`cache_rows`) and a new one joining
    mid-way; every row's logits equal its own full forward. Across the window wrap (W=8), C4 / ratio-8 window
    ends at different steps per row, and a sparse indexer (top-2 of up to 7 entries). Bugs caught: one row's
    position used for all (rope, ape, visibility), a shorter row's window padding not masked, an entry written
    for a row whose window did not end or into another row's slot, the C4 prev window not kept per row, the
    wrong rows kept when one leaves."""
    m = tiny_model(index_topk=2).eval()
    V, T = m.cfg.vocab_size, 30
    lens = [5, 13, 3, 21]                     # prefill lengths: rows stand at different positions mod 4 and 8
    seqs = [torch.randint(0, V, (1, T), generator=gen) for _ in range(5)]
    with torch.no_grad():
        fulls = [m(s)[0] for s in seqs]                                                # [T,V] each
        caches = []
        for s, L in zip(seqs, lens):
            caches.append(m.new_cache())
            m(s[:, :L], 0, caches[-1])
        cache, rows, pos, err = m.cat_caches(caches), [0, 1, 2, 3], torch.tensor(lens), 0.0
        for step in range(T - max(lens)):
            ids = torch.cat([seqs[r][:, p:p + 1] for r, p in zip(rows, pos.tolist())])  # [B,1]
            out = m(ids, pos, cache)[:, -1]                                            # [B,V]
            for i, (r, p) in enumerate(zip(rows, pos.tolist())):
                err = max(err, (out[i] - fulls[r][p]).abs().max().item())
            pos = pos + 1
            if step == 3:                         # row 2 leaves, sequence 4 joins after a prefill of 7
                keep = torch.tensor([0, 1, 3])
                cache, rows, pos = m.cache_rows(cache, keep), [0, 1, 3], pos[keep]
                joined = m.new_cache()
                m(seqs[4][:, :7], 0, joined)
                cache, rows, pos = m.cat_caches([cache, joined]), rows + [4], torch.cat([pos, torch.tensor([7])])
    assert err <= DECODE_TOL * max(f.abs().max().item() for f in fulls), f"max |diff| {err:.2e}"


@pytest.mark.usefixtures("one_thread")
def test_tokens_after_a_sequence_change_none_of_its_logits(gen):
    """Right-padding is safe for this model (the engine's batched scoring and decode="full" pad rows of
    different lengths): every block is causal -- the sliding window, the compressed entries (an entry is visible
    only once its window has ended, the C4 overlap included), the indexer's top-k over those, MoE and mHC per
    token. Rows cut at lengths across C4 / ratio-8 window ends, then padded with random tokens to 29, keep
    their logits. Bug caught: an entry visible one step early (u <= (t+1)//m), a compressor pooling a window
    that has not ended, a window mask letting a later key in."""
    m = tiny_model(index_topk=2).eval()
    V, L = m.cfg.vocab_size, 29
    ids = torch.randint(0, V, (5, L), generator=gen)
    cuts = [3, 8, 11, 16, 23]                 # 4k-1, 8k, 4k+3 (an entry ends there), 16, 23
    padded = torch.stack([torch.cat([ids[i, :c], torch.randint(0, V, (L - c,), generator=gen)])
                          for i, c in enumerate(cuts)])
    with torch.no_grad():
        got = m(padded)
        want = [m(ids[i:i + 1, :c])[0] for i, c in enumerate(cuts)]
    err = max((got[i, :c] - w).abs().max().item() for i, (c, w) in enumerate(zip(cuts, want)))
    assert err <= DECODE_TOL * max(w.abs().max().item() for w in want), f"max |diff| {err:.2e}"


def test_token_logprobs_matches_log_softmax_forward_and_backward(gen):
    m = tiny_model()
    ids = torch.randint(0, m.cfg.vocab_size, (2, 13), generator=gen)
    tgt = torch.randint(0, m.cfg.vocab_size, (2, 13), generator=gen)
    for temp in (1.0, 0.7):
        want = F.log_softmax(m(ids) / temp, -1).gather(-1, tgt[..., None])[..., 0]
        g_want = torch.autograd.grad(want.sum(), list(m.parameters()), allow_unused=True)
        got = m.token_logprobs(ids, tgt, temperature=temp, chunk=5)
        g_got = torch.autograd.grad(got.sum(), list(m.parameters()), allow_unused=True)
        assert (got - want).abs().max() < 1e-5
        for (n, _), a, b in zip(m.named_parameters(), g_got, g_want):
            assert (a is None) == (b is None), n
            if a is not None:
                assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item()), n


# mtp_logits in fp32 vs the same composition in float64 after the (shared, fp32) MTP block: a few fp32
# roundings of the hc_head / norm / head tail, relative to the logit (gradient) scale.
MTP_FWD_RTOL, MTP_GRAD_RTOL = 1e-5, 1e-4


def test_mtp_logits_match_reference_forward_and_backward(gen):
    """logits = head(norm_mtp(hc_head_mtp(MTPBlock(h, next)))): the MTP layer's own hc_head and norm, the
    shared head. Gradients equal the reference's, and the main model's hc_head / norm get none."""
    m = tiny_model()
    with torch.no_grad():   # distinct norms and hc_head weights, so using the main model's ones would show
        for n, p in m.named_parameters():
            if n.endswith(("norm.weight", "hc_head_scale")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    cfg, blk = m.cfg, m.mtp["0"]
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=gen)
    h = m.run_layers(m.embed_streams(ids), ids).detach()
    nxt = torch.roll(ids, -1, 1)

    def reference():            # MTPBlock itself is checked against tests/reference.py in test_model_blocks.py
        x = blk(h, nxt, m.embed).double()
        xf = x.flatten(2)
        mixes = (xf @ blk.hc_head_fn.double().T) / torch.sqrt((xf * xf).mean(-1, keepdim=True) + cfg.norm_eps)
        pre = torch.sigmoid(mixes * blk.hc_head_scale.double() + blk.hc_head_base.double()) + cfg.hc_eps
        y = (pre[..., None] * x).sum(2)
        y = y * torch.rsqrt((y * y).mean(-1, keepdim=True) + cfg.norm_eps) * blk.norm.weight.double()
        return y @ m.head.weight.double().T

    got, want = m.mtp_logits(h, nxt), reference()
    assert got.shape == (2, 9, cfg.vocab_size) and got.dtype == torch.float32
    assert (got - want).abs().max() <= MTP_FWD_RTOL * want.abs().max()
    cot = torch.randn(got.shape, generator=gen)
    names, params = zip(*m.named_parameters())
    g_got = torch.autograd.grad((got * cot).sum(), params, allow_unused=True)
    g_want = torch.autograd.grad((want * cot.double()).sum(), params, allow_unused=True)
    for n, a, b in zip(names, g_got, g_want):
        assert (a is None) == (b is None), n
        if a is not None:
            assert (a - b).abs().max() <= MTP_GRAD_RTOL * b.abs().max().clamp_min(1e-12), n
    touched = {n for n, a in zip(names, g_got) if a is not None}
    assert {"mtp.0.e_proj.weight", "mtp.0.hc_head_fn", "mtp.0.norm.weight", "head.weight", "embed.weight"} <= touched
    assert not touched & {"hc_head_fn", "hc_head_base", "hc_head_scale", "norm.weight"}, "main hc_head / norm used"


def test_recompute_gives_identical_gradients(gen):
    m = tiny_model()
    ids = torch.randint(0, m.cfg.vocab_size, (2, 11), generator=gen)
    loss = lambda: m(ids).logsumexp(-1).mean()
    g1 = torch.autograd.grad(loss(), list(m.parameters()), allow_unused=True)
    m.recompute = True
    g2 = torch.autograd.grad(loss(), list(m.parameters()), allow_unused=True)
    for a, b in zip(g1, g2):
        assert (a is None and b is None) or torch.equal(a, b)


def test_qat_switch_changes_numerics_but_not_much(gen):
    """QAT simulates FP8/FP4 roundings: a few % per op, so at the default init (std 0.02, gains < 1) the logits
    move by a few % -- and every Linear that the release stores in FP8 quantizes its input."""
    m = Transformer(preset("tiny", index_topk=64)).init_weights(0)
    ids = torch.randint(0, m.cfg.vocab_size, (1, 24), generator=gen)
    q = Transformer(preset("tiny", index_topk=64, qat=True))
    q.load_state_dict(m.state_dict())
    with torch.no_grad():
        a, b = m(ids), q(ids)
    diff = (a - b).abs().max().item()
    assert 0 < diff < 0.1 * a.abs().max().item(), f"QAT simulation diff {diff}"
    q(ids).sum().backward()   # straight-through gradients flow
    assert q.layers["0"].attn.wq_a.weight.grad.abs().sum() > 0
    fp8_inputs = {n for n, mod in q.named_modules() if getattr(mod, "qat_input", False)}
    assert {"layers.0.attn.wq_a", "layers.0.attn.wo_b", "layers.1.attn.indexer.wq_b",
            "layers.0.ffn.shared_experts.w1", "mtp.0.e_proj"} <= fp8_inputs
    assert q.layers["0"].ffn.experts.cfg.qat  # stacked routed experts quantize both GEMM inputs (tests/test_model_moe.py)
    assert not {"layers.0.attn.wo_a", "layers.1.attn.compressor.wkv", "head", "layers.1.attn.indexer.weights_proj"} \
        & fp8_inputs, "BF16 weights of the release get no FP8 activation quantization"


# The official QAT sites and blocks (v4_notes §2.6, inference/model.py act_quant / fp4_act_quant), written out here
# rather than imported, so a wrong constant in model.py shows. The config makes every block size visible:
# every Linear input a multiple of 128 (block 128, not a test-size gcd), kv nope dims 136 - 8 = 128 (block 64,
# not 128), indexer head dim 64 (FP4 block 32, not 64).
QAT_ACT_BLOCK, QAT_KV_BLOCK, QAT_FP4_BLOCK = 128, 64, 32
QAT_CFG = dict(dim=256, q_lora_rank=128, o_lora_rank=64, moe_inter_dim=128, head_dim=136, index_head_dim=64,
               index_topk=64)


def _qat_spy(model, monkeypatch):
    """Replace the model's fp8/fp4 simulations by identity spies that record (site, last dim, block)."""
    import nanoflash.model as M
    # rotated: id -> tensor. Keeping each Hadamard output alive keeps its id unique: a freed tensor's id can be
    # reused by a later kv tensor, which then counted as "rotated" (the test failed in some whole-suite orders).
    calls, current, rotated = [], [None], {}
    for name, mod in model.named_modules():
        if isinstance(mod, (M.Linear, M.RoutedExperts)):  # stacked experts: their two GEMM inputs
            mod.register_forward_pre_hook(lambda m, a, n=name: current.__setitem__(0, (n, m)))
            mod.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))

    def spy(kind):
        def sim(x, block):
            site = current[0][0] if current[0] else "rotated" if id(x) in rotated else "other"
            calls.append((kind, site, x.shape[-1], block, current[0][1] if current[0] else None))
            return x
        return sim

    def had(x):
        y = hadamard(x)
        rotated[id(y)] = y
        return y
    monkeypatch.setattr(M, "fp8_sim", spy("fp8"))
    monkeypatch.setattr(M, "fp4_sim", spy("fp4"))
    monkeypatch.setattr(M, "hadamard", had)
    return calls


def test_qat_is_the_plain_model_plus_exactly_the_official_sites(monkeypatch, gen):
    """With the simulations replaced by identities the QAT model equals the plain one bit for bit (QAT adds
    nothing else), and the simulations it calls are exactly: FP8 per 1x128 on the input of every FP8-stored
    Linear it runs; FP8 per 64 on the kv nope dims of every attention layer and every non-rotating compressor;
    Hadamard then FP4 per 32 on the indexer's q and keys."""
    plain = Transformer(preset("tiny", **QAT_CFG)).init_weights(0)
    q = Transformer(preset("tiny", qat=True, **QAT_CFG))
    q.load_state_dict(plain.state_dict())
    calls = _qat_spy(q, monkeypatch)
    ids = torch.randint(0, plain.cfg.vocab_size, (1, 24), generator=gen)
    with torch.no_grad():
        assert torch.equal(q(ids), plain(ids)), "QAT with identity simulations must be the plain model"
    cfg = q.cfg
    for kind, site, n, block, mod in calls:
        if isinstance(mod, RoutedExperts):
            assert kind == "fp8" and n in (cfg.dim, cfg.moe_inter_dim) and block == QAT_ACT_BLOCK, (site, n, block)
        elif mod is not None:
            assert kind == "fp8" and mod.qat_input and n == mod.in_features and block == QAT_ACT_BLOCK, (site, n, block)
    ran_qat_linears = {site for kind, site, *_ in calls if site not in ("other", "rotated")}
    assert {"layers.0.attn.wq_a", "layers.0.attn.wo_b", "layers.1.attn.indexer.wq_b", "layers.0.ffn.experts",
            "layers.0.ffn.shared_experts.w2"} <= ran_qat_linears
    n_attn = cfg.n_layers
    n_plain_compressors = sum(1 for r in cfg.compress_ratios[:cfg.n_layers] if r)
    n_indexers = sum(1 for r in cfg.compress_ratios[:cfg.n_layers] if r == 4)
    kv = [c[:4] for c in calls if c[1] == "other"]
    assert kv == [("fp8", "other", cfg.head_dim - cfg.rope_head_dim, QAT_KV_BLOCK)] * len(kv) \
        and len(kv) == n_attn + n_plain_compressors, kv
    fp4 = [c[:4] for c in calls if c[0] == "fp4"]
    assert fp4 == [("fp4", "rotated", cfg.index_head_dim, QAT_FP4_BLOCK)] * (2 * n_indexers), fp4


def test_bf16_cast_keeps_fp32_parameters(gen):
    m = tiny_model().cast_(torch.bfloat16)
    dt = {n: p.dtype for n, p in m.named_parameters()}
    assert dt["layers.0.attn.wq_a.weight"] == torch.bfloat16
    assert dt["layers.0.hc_attn_fn"] == dt["layers.1.attn.compressor.ape"] == dt["head.weight"] == torch.float32
    assert m(torch.randint(0, 256, (1, 10), generator=gen)).dtype == torch.float32


def test_model_py_style():
    """Every class docstring carries `Shapes:` (or is a dataclass state record); no distributed code."""
    src = pathlib.Path(__file__).parents[1].joinpath("nanoflash/model.py").read_text()
    tree = ast.parse(src)
    assert ast.get_docstring(tree), "module docstring"
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            doc = ast.get_docstring(node) or ""
            is_record = any(getattr(d, "id", None) == "dataclass" for d in node.decorator_list)
            assert is_record or "Shapes:" in doc or node.name.startswith("_"), f"class {node.name}"
        if isinstance(node, ast.FunctionDef):
            assert node.end_lineno - node.lineno < 60, f"{node.name} is {node.end_lineno - node.lineno} lines"
    assert "torch.distributed" not in src and "dist." not in src


def test_decode_real_window_and_c128_boundary(gen):
    """The published geometry of the sequence axis: window 128 (ring wrap) and a true 128:1 compressor, decoding
    across position 255, where the first C128 entry beyond w=0 completes."""
    cfg = preset("tiny", window_size=128, compress_ratios=(0, 4, 128, 4, 0), index_topk=64)
    m = Transformer(cfg).init_weights(0, std=0.2).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 262), generator=gen)
    with torch.no_grad():
        full, cache = m(ids), m.new_cache()
        parts = [m(ids[:, :240], 0, cache)] + [m(ids[:, t:t + 1], t, cache) for t in range(240, 262)]
    assert len(cache["2"].comp[0]) == 2, "two complete C128 windows after 262 tokens"
    assert (torch.cat(parts, 1) - full).abs().max().item() <= DECODE_TOL * full.abs().max().item()
