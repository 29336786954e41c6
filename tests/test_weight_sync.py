"""Weight-sync stream, SGLang loader layout and push protocol order (no server: a recording fake client).

Run: `pytest tests/test_weight_sync.py -q`.
"""
from __future__ import annotations

import pytest
import torch

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.quant import dequantize_fp8_block, quantize_fp8_block
from nanoflash.sglang.client import SGLangClient
from nanoflash.sglang.layout import (LoaderState, compare_checksums, expected_checksums, from_sglang,
                                      permute_ape, sglang_fp8, to_sglang, unpermute_ape)
from nanoflash.sglang.transports import (ATOMIC, decode_tensors, encode_tensors, iter_sglang_buckets,
                                           push_weights)

E4M3_HALF_ULP_REL = 2.0 ** -4   # e4m3 keeps 3 mantissa bits: rounding error <= |x| * 2^-4 (normal range)
E4M3_SUBNORMAL_ABS = 2.0 ** -10  # below 2^-6 the grid is 2^-9: error <= 2^-10 in scaled units


@pytest.fixture(scope="module")
def model():
    return Transformer(preset("tiny")).init_weights(0)


def _stream(model, fp8, bucket_bytes=1 << 40):
    return list(iter_sglang_buckets(model, fp8=fp8, bucket_bytes=bucket_bytes))


def naive_miles_fp8(w: torch.Tensor):
    """Per-128x128-block loop of Miles' Hopper convention: S = max(amax, 1e-10)/448, Q = e4m3(clamp(W*(1/S)))."""
    m, n = w.shape
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty((m + 127) // 128, (n + 127) // 128)
    for i in range(0, m, 128):
        for j in range(0, n, 128):
            blk = w[i:i + 128, j:j + 128].float()
            sc = torch.clamp(blk.abs().max(), min=1e-10) / 448.0
            s[i // 128, j // 128] = sc
            q[i:i + 128, j:j + 128] = (blk * (1.0 / sc)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


@pytest.mark.parametrize("shape", [(128, 128), (200, 300), (7, 129), (256, 64)])
def test_fp8_quantizer_matches_naive_reference_bit_for_bit(shape):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = torch.randn(shape, generator=g) * torch.logspace(-4, 1, shape[1])[None]  # blocks of very different scale
    q, s = quantize_fp8_block(w, fmt="fp32")
    rq, rs = naive_miles_fp8(w)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_fp8_round_trip_within_e4m3_tolerance():
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(1)) * 0.05
    q, s = quantize_fp8_block(w, fmt="fp32")
    deq = dequantize_fp8_block(q, s, torch.float32)
    sfull = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    bound = torch.maximum(w.abs() * E4M3_HALF_ULP_REL, sfull * E4M3_SUBNORMAL_ABS)
    assert ((deq - w).abs() <= bound).all(), float(((deq - w).abs() - bound).max())


def test_names_round_trip_and_known_spellings(model):
    names = [n for n in model.state_dict() if not n.startswith("mtp.")]
    for n in names:
        assert from_sglang(to_sglang(n)) == n
    assert to_sglang("embed.weight") == "model.embed_tokens.weight"
    assert to_sglang("layers.0.ffn.gate.tid2eid") == "model.layers.0.mlp.topk.tid2eid"
    assert to_sglang("layers.3.ffn.gate.bias") == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert to_sglang("layers.1.ffn.experts.5.w3.weight") == "model.layers.1.mlp.experts.5.up_proj.weight"
    assert to_sglang("layers.2.attn_norm.weight") == "model.layers.2.input_layernorm.weight"
    with pytest.raises(KeyError, match="MTP"):
        to_sglang("mtp.0.e_proj.weight")


def test_fp8_stream_dtypes_follow_sglang(model):
    sent = {n: t for b in _stream(model, fp8=True) for n, t in b}
    fp8 = {n for n, t in sent.items() if t.dtype == torch.float8_e4m3fn}
    for n in fp8:
        assert sent[n + "_scale_inv"].dtype == torch.float32
    must_fp8 = ["self_attn.wq_a.weight", "self_attn.wkv.weight", "self_attn.wq_b.weight", "self_attn.wo_b.weight",
                "self_attn.indexer.wq_b.weight", "mlp.experts.3.gate_proj.weight",
                "mlp.shared_experts.down_proj.weight"]
    for s in must_fp8:
        assert f"model.layers.1.{s}" in fp8, s
    keep = {"self_attn.wo_a.weight": torch.bfloat16, "self_attn.compressor.wkv.weight": torch.bfloat16,
            "self_attn.indexer.weights_proj.weight": torch.bfloat16, "self_attn.compressor.ape": torch.float32,
            "hc_attn_fn": torch.float32, "self_attn.attn_sink": torch.float32, "mlp.gate.weight": torch.bfloat16,
            "input_layernorm.weight": torch.bfloat16}
    for s, dt in keep.items():
        assert sent[f"model.layers.1.{s}"].dtype == dt, s
    assert sent["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert sent["model.layers.0.mlp.topk.tid2eid"].dtype == torch.int64
    assert torch.equal(sent["model.layers.0.mlp.topk.tid2eid"], model.layers["0"].ffn.gate.tid2eid)
    assert not sglang_fp8("layers.1.attn.wo_a.weight", model.cfg)


def test_bucket_rules_pairs_bytes_order_coverage(model):
    limit = 6000
    buckets = _stream(model, fp8=True, bucket_bytes=limit)
    assert len(buckets) > 10
    where = {}
    for i, b in enumerate(buckets):
        sizes = [t.element_size() for _, t in b]
        assert sizes == sorted(sizes, reverse=True), f"bucket {i} not ordered by element size: {sizes}"
        nbytes = sum(t.numel() * t.element_size() for _, t in b)
        for n, _ in b:
            assert n not in where, f"{n} sent twice"
            where[n] = i
        if nbytes > limit:  # only a single indivisible unit may exceed the limit
            stems = {from_sglang(n).replace("_scale_inv", "") for n, _ in b}
            assert len(stems) <= 2, f"bucket {i} has {nbytes} B > {limit} with {sorted(stems)}"
    experts = range(model.cfg.n_routed_experts)
    units = [(a.replace("#", str(e)), b.replace("#", str(e)))
             for a, b in ATOMIC for e in (experts if "#" in a else [0])]
    assert len(units) == len(ATOMIC) - 1 + model.cfg.n_routed_experts
    for layer in range(model.cfg.n_layers):
        for a, b in units:
            na, nb = to_sglang(f"layers.{layer}.{a}"), to_sglang(f"layers.{layer}.{b}")
            if na in where:
                assert where[na] == where[nb], f"atomic pair {na} / {nb} split"
                if na + "_scale_inv" in where:
                    assert where[na + "_scale_inv"] == where[nb + "_scale_inv"] == where[na]
    official = {n for n in model.state_dict() if not n.startswith("mtp.")}
    assert {from_sglang(n) for n in where if not n.endswith("_scale_inv")} == official


def test_loader_refuses_split_pair_and_layout_is_sglangs(model):
    sent = {n: t for b in _stream(model, fp8=False) for n, t in b}
    qa, kv = "model.layers.1.self_attn.wq_a.weight", "model.layers.1.self_attn.wkv.weight"
    st = LoaderState()
    with pytest.raises(ValueError, match="atomic pair split"):
        st.load([(qa, sent[qa])])
    st.load([(qa, sent[qa]), (kv, sent[kv])])
    assert torch.equal(st.params["model.layers.1.self_attn.wqkv_a.weight"], torch.cat([sent[qa], sent[kv]]))
    ape = sent["model.layers.1.self_attn.compressor.ape"]
    st.load([("model.layers.1.self_attn.compressor.ape", ape)])
    assert torch.equal(st.params["model.layers.1.self_attn.compressor.ape"], permute_ape(ape))
    assert torch.equal(unpermute_ape(permute_ape(ape)), ape)
    st.load([("model.layers.0.mlp.topk.tid2eid", sent["model.layers.0.mlp.topk.tid2eid"])])
    assert st.params["model.layers.0.mlp.topk.tid2eid"].dtype == torch.int32


def test_checksums_catch_missing_and_changed_tensors(model):
    buckets = _stream(model, fp8=True, bucket_bytes=1 << 16)
    expected = expected_checksums(buckets)
    assert any("tid2eid" in n for n in expected)
    compare_checksums(expected, dict(expected))
    forgot = [[(n, t) for n, t in b if "tid2eid" not in n] for b in buckets]
    stale = dict(expected_checksums(forgot))
    stale["model.layers.0.mlp.topk.tid2eid"] = "0" * 64  # the server kept an old table
    with pytest.raises(RuntimeError, match="tid2eid"):
        compare_checksums(expected, stale)
    with pytest.raises(RuntimeError, match="missing"):
        compare_checksums(expected, expected_checksums(forgot))


def test_safe_codec_round_trip_and_refuses_pickle():
    named = [("b", torch.arange(6, dtype=torch.int64).view(2, 3)), ("a", torch.randn(3).to(torch.float8_e4m3fn))]
    back = decode_tensors(encode_tensors(named))
    assert [n for n, _ in back] == ["b", "a"]
    assert torch.equal(back[0][1], named[0][1])
    assert torch.equal(back[1][1].view(torch.uint8), named[1][1].view(torch.uint8))
    import base64
    import pickle
    with pytest.raises(ValueError, match="never unpickles"):
        decode_tensors(base64.b64encode(pickle.dumps({"x": 1})).decode())


class RecordingClient(SGLangClient):
    """A fake engine: records (method, path) of every call and answers like SGLang would."""

    def __init__(self, routes, checksums=None):
        super().__init__(["http://fake:1"], retry_s=0.0)
        self.routes, self.calls, self.checksums = set(routes), [], checksums

    def request(self, url, method, path, body=None, timeout=None, retry_s=None):
        self.calls.append(path)
        if path == "/openapi.json":
            return {"paths": {p: {} for p in self.routes}}
        if path == "/get_server_info":
            return {"engine": "nanoflash", "version": "0.5.16"}
        if path == "/weights_checker":
            return {"success": True, "ranks": [{"checksums": self.checksums}]}
        return {"success": True}


@pytest.mark.parametrize("routes,bracket", [
    ([], ([], [])),
    (["/post_process_weights"], (["/post_process_weights"], ["/post_process_weights"])),
    (["/begin_weight_update", "/end_weight_update"], (["/begin_weight_update"], ["/end_weight_update"]))])
def test_push_call_order_per_protocol_generation(model, routes, bracket):
    buckets = _stream(model, fp8=True, bucket_bytes=1 << 16)
    fake = RecordingClient(routes, checksums=expected_checksums(buckets))
    out = push_weights(fake, buckets)
    calls = [c for c in fake.calls if c not in ("/openapi.json", "/get_server_info")]
    want = (["/pause_generation", "/flush_cache"] + bracket[0] + ["/update_weights_from_tensor"] * len(buckets)
            + bracket[1] + ["/continue_generation", "/weights_checker"])
    assert calls == want
    assert out["buckets"] == len(buckets) and fake.weight_version == 1  # the version bumps per push
    fake_bad = RecordingClient(routes, checksums={})
    with pytest.raises(RuntimeError, match="did not land"):
        push_weights(fake_bad, buckets, version=4)


def test_loader_call_is_all_or_nothing_and_refuses_shape_or_dtype_change(model):
    sent = {n: t for b in _stream(model, fp8=True) for n, t in b}
    st = LoaderState()
    st.load(list(sent.items()))
    before = st.checksums()
    norm, qa = "model.layers.1.input_layernorm.weight", "model.layers.1.self_attn.wq_a.weight"
    with pytest.raises(ValueError, match="atomic pair"):       # a good tensor plus a half pair: nothing lands
        st.load([(norm, sent[norm] * 2), (qa, sent[qa])])
    with pytest.raises(ValueError, match="holds"):              # wrong width (SGLang would partly write it)
        st.load([(norm, torch.zeros(7, dtype=torch.bfloat16))])
    wq_b = "model.layers.1.self_attn.wq_b.weight"
    with pytest.raises(ValueError, match="holds"):              # bf16 into an fp8 slot (SGLang casts silently)
        st.load([(wq_b, sent[wq_b].float().to(torch.bfloat16))])
    assert st.checksums() == before


def test_real_sglang_servers_are_checked_for_consistency():
    from nanoflash.sglang.transports import verify_push

    class TwoReal(SGLangClient):
        def __init__(self, sums):
            super().__init__(["http://a:1", "http://b:1"], retry_s=0.0)
            self.sums = sums

        def request(self, url, method, path, body=None, timeout=None, retry_s=None):
            if path == "/get_server_info":
                return {"version": "0.5.16"}  # no "engine": nanoflash -> real SGLang
            return {"success": True, "ranks": [{"checksums": self.sums[url]}]}
    same = {"x": "1", "y": "2"}
    assert verify_push(TwoReal({"http://a:1": same, "http://b:1": same}), {"anything": "0"}) == \
        [("http://a:1", "consistency"), ("http://b:1", "consistency")]
    with pytest.raises(RuntimeError, match="differ"):
        verify_push(TwoReal({"http://a:1": same, "http://b:1": {"x": "1", "y": "3"}}), {})
