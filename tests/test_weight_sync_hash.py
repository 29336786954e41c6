"""SGLang 0.5.16's `/weights_checker` hash, reproduced on the trainer side (`layout.sglang_hash`,
`sglang_partials`): against a word-by-word transcription of its Triton kernel, and piecewise for the stacked
expert tensors (per-expert slabs from several sources must give the hash of the whole stacked tensor).

Run: `pytest tests/test_weight_sync_hash.py -q`.
"""
from __future__ import annotations

import pytest
import torch

from nanoflash.quant import dequantize_fp8_block, quantize_fp8_block
from nanoflash.sglang.layout import HASH_TILE_WORDS, LoaderState, sglang_checksums, sglang_hash, sglang_partials

M32 = 0xFFFFFFFF


def _fmix32(x):
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def naive_gpu_tensor_hash(t: torch.Tensor) -> str:
    """sglang/kernels/ops/memory/gpu_tensor_hash.py (0.5.16), one word at a time in Python integers."""
    b = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
    b += bytes(-len(b) % 4)
    words = [int.from_bytes(b[i:i + 4], "little") for i in range(0, len(b), 4)]
    seed = 0x243F6A88
    s1, s2 = seed & M32, ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & M32
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & M32  # noqa: E731
    total = 0
    for base in range(0, len(words), HASH_TILE_WORDS):
        h1 = h2 = 0
        for i in range(base, min(base + HASH_TILE_WORDS, len(words))):
            h1 = (h1 + _fmix32(words[i] ^ (((i * 0x27D4EB2D + s1) & M32) ^ rotl(i, 15)))) & M32
            h2 = (h2 + _fmix32(words[i] ^ (((i * 0x165667B1 + s2) & M32) ^ rotl(i, 13)))) & M32
        nbytes = (len(words) * 4) & M32
        total = (total + ((_fmix32(h1 ^ nbytes) << 32) | _fmix32(h2 ^ nbytes))) & ((1 << 64) - 1)
    x = total
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return f"{x ^ (x >> 31):016x}"


@pytest.mark.parametrize("numel,dtype", [(5, torch.float32), (3, torch.bfloat16), (8192, torch.float32),
                                         (8192 * 2 + 77, torch.bfloat16), (9001, torch.float8_e4m3fn)])
def test_hash_matches_word_by_word_transcription(numel, dtype, gen):
    t = (torch.randn(numel, generator=gen) * 3).to(dtype)   # spans whole tiles, a short last tile, padding
    assert sglang_hash(t) == naive_gpu_tensor_hash(t)
    u = t.clone()
    u.view(torch.uint8)[-1] ^= 1                           # one bit anywhere changes it
    assert sglang_hash(u) != sglang_hash(t)


def test_stacked_experts_hash_from_slabs_of_several_buckets(gen):
    """Four experts' w1/w3/w2 (FP8, 128x128 blocks) sent in two buckets: the merged partials must equal the
    hash of the stacked, dequantized [E, 2I, D] / [E, D, I] tensors, as SGLang's checker computes them."""
    E, I, D = 4, 128, 256
    layers = {e: [torch.randn(I, D, generator=gen), torch.randn(I, D, generator=gen),
                  torch.randn(D, I, generator=gen)] for e in range(E)}
    stacked13, stacked2, partials = [], [], {}
    for part in ([0, 1], [2, 3]):                            # two buckets, as two sources would send them
        named = []
        for e in part:
            for leaf, w in zip(("gate_proj", "up_proj", "down_proj"), layers[e]):
                q, s = quantize_fp8_block(w, fmt="fp32")
                named += [(f"model.layers.2.mlp.experts.{e}.{leaf}.weight", q),
                          (f"model.layers.2.mlp.experts.{e}.{leaf}.weight_scale_inv", s)]
        st = LoaderState()
        st.load(named)
        partials.update(sglang_partials(st.params, E))
        for e in part:
            g, u, d = (dequantize_fp8_block(*quantize_fp8_block(w, fmt="fp32"), dtype=torch.bfloat16)
                       for w in layers[e])
            stacked13.append(torch.cat([g, u]))
            stacked2.append(d)
    ours = sglang_checksums(partials)
    assert ours["model.layers.2.mlp.experts.w13_weight"] == (sglang_hash(torch.stack(stacked13)),
                                                             sglang_hash(torch.stack(stacked13)), True)
    assert ours["model.layers.2.mlp.experts.w2_weight"][0] == sglang_hash(torch.stack(stacked2))
    assert not any(k.endswith("_scale_inv") for k in ours)   # SGLang lists the weight, not its scale
    del partials["model.layers.2.mlp.experts.w2_weight#3"]  # a lost bucket changes the merged value
    assert sglang_checksums(partials)["model.layers.2.mlp.experts.w2_weight"][0] != ours[
        "model.layers.2.mlp.experts.w2_weight"][0]


class FakeReal:
    """A real SGLang server's `/weights_checker`, per rank, with what it would answer."""

    def __init__(self, ranks):
        self.ranks = ranks

    def weights_checksums_per_rank(self, url):
        return self.ranks


def _ours(model):
    from nanoflash.sglang.transports import iter_sglang_buckets
    partials = {}
    for b in iter_sglang_buckets(model, fp8=True, bucket_bytes=1 << 16):
        st = LoaderState()
        st.load(b)
        partials.update(sglang_partials(st.params, model.cfg.n_routed_experts))
    return sglang_checksums(partials)


def test_real_server_verification_exact_then_by_change_sets():
    from nanoflash.config import preset
    from nanoflash.model import Transformer
    from nanoflash.sglang.transports import PushFailed, verify_real_server
    model = Transformer(preset("tiny")).init_weights(0)
    ours = _ours(model)
    raw = sorted(n for n, (_, _, fp8) in ours.items() if not fp8)
    assert any("experts.w13_weight" in n for n, (_, _, fp8) in ours.items() if fp8)
    slabs = [n for n, (h, _, _) in ours.items() if h is None]   # tiny experts: slabs of 2048 words, not whole tiles
    assert slabs and all("experts.w" in n for n in slabs)
    tp1 = {n: h or "not-reproducible" for n, (h, _, _) in ours.items()}
    tp1[raw[0]] = "stored-in-another-dtype"                 # a raw tensor SGLang keeps in its own dtype
    out = verify_real_server(FakeReal([tp1]), "u", ours, None)
    assert (out["exact"], out["first_push_unchecked"]) == (len(ours) - 1 - len(slabs), 1 + len(slabs))
    bad = dict(tp1, **{"model.layers.1.self_attn.wqkv_a.weight": "0" * 16})
    with pytest.raises(PushFailed, match="wqkv_a"):          # an FP8 tensor must match exactly
        verify_real_server(FakeReal([bad]), "u", ours, None)
    tp2 = [{n: f"r{r}-{h}" for n, (h, _, _) in ours.items()} for r in range(2)]   # TP 2: shards, own hashes
    state = verify_real_server(FakeReal(tp2), "u", ours, None)["state"]
    with torch.no_grad():
        model.layers["1"].attn.wq_b.weight.mul_(2)
    ours2 = _ours(model)
    moved = [{n: (v + "'" if n == "model.layers.1.self_attn.wq_b.weight" else v) for n, v in r.items()} for r in tp2]
    assert verify_real_server(FakeReal(moved), "u", ours2, state)["change_sets"] == 2 * len(ours)
    with pytest.raises(PushFailed, match="did not change"):  # the server kept the old wq_b on both ranks
        verify_real_server(FakeReal(tp2), "u", ours2, state)
