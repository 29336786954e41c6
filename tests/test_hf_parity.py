"""Whole-model parity with an independent implementation: transformers' `DeepseekV4ForCausalLM` (>= 5.17).

A tiny transformers model is random-initialised, its weights are converted through nanoflash's name table
(`hf_state_dict_to_nanoflash`) and loaded into `Transformer`, and the fp32 logits are compared. The known,
legitimate differences are handled explicitly rather than by loosening the tolerance:
* transformers clamps the shared expert (the official model does not): the test asserts the shared expert's
  pre-activations stay inside +-swiglu_limit, so the clamp is provably inactive;
* transformers mixes mHC post in the activation dtype: identical here because everything runs in fp32;
* transformers has no MTP: the nanoflash model is built with n_mtp_layers = 0;
* the indexer's top-k is only defined up to ties: the sparse run uses 16 indexer heads, so no entry's
  score is a ReLU zero of every head, and asserts a margin at every query's cut far above fp32 rounding.
"""
import pytest
import torch

import reference as ref
from nanoflash.names import hf_state_dict_to_nanoflash
from nanoflash.config import preset
from nanoflash.model import Indexer, Transformer, hc_post

transformers = pytest.importorskip("transformers")
# Same fp32 math, different association orders (F.linear(x*rsqrt) vs (x@W)*rsqrt, matmul vs einsum): the
# measured max |dlogit| is ~1e-7; 1e-4 is the target.
PARITY_TOL = 1e-4
SPARSE_TOPK = 3   # of up to 9 C4 entries (37 tokens): queries t >= 15 drop entries
SPARSE_INDEX_HEADS = 16  # P(all heads' ReLU = 0) = 2^-16 per entry: no ties of zeros at the cut
# k-th minus (k+1)-th score at the cut, relative to the largest score: fp32 score rounding is ~1e-7 relative,
# so 1e-4 means the two implementations cannot order the cut differently (measured minimum: ~1e-3).
SCORE_MARGIN_REL = 1e-4
LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 8: "heavily_compressed_attention"}


def hf_config(cfg):
    n = cfg.n_layers
    c = transformers.DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.moe_inter_dim,
        num_hidden_layers=n, num_attention_heads=cfg.n_heads, head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        partial_rotary_factor=cfg.rope_head_dim / cfg.head_dim, num_experts_per_tok=cfg.n_activated_experts,
        n_routed_experts=cfg.n_routed_experts, routed_scaling_factor=cfg.route_scale,
        layer_types=[LAYER_TYPES[r] for r in cfg.compress_ratios[:n]],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        compress_rope_theta=cfg.compress_rope_theta, rope_theta=cfg.rope_theta, hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, swiglu_limit=cfg.swiglu_limit,
        mlp_layer_types=["hash_moe"] * cfg.n_hash_layers + ["moe"] * (n - cfg.n_hash_layers),
        sliding_window=cfg.window_size, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.original_seq_len * int(cfg.rope_factor),
        rope_parameters={"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                         "beta_slow": cfg.beta_slow, "original_max_position_embeddings": cfg.original_seq_len},
        num_nextn_predict_layers=0)
    c._attn_implementation = "eager"
    return c


def build_pair(index_topk: int, **overrides):
    """(cfg, transformers model, nanoflash model with the same weights), seeded."""
    cfg = preset("tiny", n_mtp_layers=0, compress_ratios=(0, 4, 8, 4), index_topk=index_topk, **overrides)
    torch.manual_seed(0)   # transformers' own init draws on the global RNG; every value is overwritten below
    hf = transformers.DeepseekV4ForCausalLM(hf_config(cfg)).float().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in hf.named_parameters():   # hc bases far from 0 so comb is far from symmetric
            std = 2.0 if n.endswith("hc.base") else 1.0 if n.endswith(("sinks", "position_bias")) else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std)
        for n, b in hf.named_buffers():
            if n.endswith("tid2eid"):
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape, generator=g))
            elif n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    ours = Transformer(cfg)
    missing, unexpected = ours.load_state_dict(hf_state_dict_to_nanoflash(hf.state_dict(), cfg), strict=True)
    assert not missing and not unexpected
    return cfg, hf, ours.eval()


@pytest.fixture(scope="module")
def pair():
    return build_pair(index_topk=64)          # >= the 9 C4 entries of 37 tokens: every entry kept


@pytest.fixture(scope="module")
def sparse_pair():
    return build_pair(index_topk=SPARSE_TOPK, index_n_heads=SPARSE_INDEX_HEADS)  # the indexer's choice matters


def shared_expert_preacts(model, ids):
    seen = []
    hooks = [m.register_forward_hook(lambda mod, i, o: seen.append(o.abs().max().item()))
             for n, m in model.named_modules() if n.endswith(("shared_experts.w1", "shared_experts.w3"))]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return max(seen)


def test_logits_match_transformers(pair, gen):
    cfg, hf, ours = pair
    ids = torch.randint(0, cfg.vocab_size, (2, 37), generator=gen)   # 4 windows of 8, 9 C4 entries, ring wraps
    assert shared_expert_preacts(ours, ids) < cfg.swiglu_limit, "HF's shared-expert clamp would be active"
    with torch.no_grad():
        err = (hf(ids).logits - ours(ids)).abs().max().item()
    print(f"max |dlogit| vs transformers: {err:.3e}")
    assert err <= PARITY_TOL


def test_parity_discriminates_planted_comb_bug(pair, monkeypatch, gen):
    """The same comparison with comb applied untransposed must fail the tolerance by a wide margin."""
    cfg, hf, ours = pair
    ids = torch.randint(0, cfg.vocab_size, (2, 37), generator=gen)
    import nanoflash.model as M
    monkeypatch.setattr(M, "hc_post", lambda x, res, post, comb: hc_post(x, res, post, comb.transpose(-1, -2)))
    with torch.no_grad():
        err = (hf(ids).logits - ours(ids)).abs().max().item()
    assert err > 10 * PARITY_TOL, f"planted comb bug only moved logits by {err:.2e}"


def test_logits_match_transformers_with_sparse_indexer(sparse_pair, gen):
    """index_topk = 3 of up to 9 compressed entries, so the independent oracle checks which entries the
    indexer keeps (an indexer keeping the lowest scores, or the wrong visibility, moves logits by >> 1e-4)."""
    cfg, hf, ours = sparse_pair
    ids = torch.randint(0, cfg.vocab_size, (2, 37), generator=gen)
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append((mod, args[0], args[1])))
             for m in ours.modules() if isinstance(m, Indexer)]
    with torch.no_grad():
        err = (hf(ids).logits - ours(ids)).abs().max().item()
    for h in hooks:
        h.remove()
    assert len(seen) == 2, "both C4 layers ran their indexer"
    for mod, x, qr in seen:
        scores = ref.indexer_scores(mod, x, qr, cfg).sort(-1, descending=True).values   # [B,S,C] float64
        cut = torch.isfinite(scores).sum(-1) > SPARSE_TOPK                             # queries that drop entries
        assert cut.sum() >= 20, "the selection must actually drop entries"
        gap = (scores[..., SPARSE_TOPK - 1] - scores[..., SPARSE_TOPK])[cut]
        scale = scores[torch.isfinite(scores)].abs().max()
        assert gap.min() > SCORE_MARGIN_REL * scale, f"near-tie at the top-k cut: {gap.min():.2e} (scale {scale:.2e})"
    print(f"max |dlogit| vs transformers, sparse indexer: {err:.3e}")
    assert err <= PARITY_TOL
