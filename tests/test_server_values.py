"""The embedded server's weight updates and probes at their edges (issue 39, low list).

Bugs caught, one test each: NaN / inf / out-of-range tensors (an expert table with an id past n_experts)
accepted by a weight update with HTTP 200, failing only at /generate; /health_generate missing an inf in one
embedding row (its one-token prompt never reads it); a corrupt file of a disk update not named; the version
tag set before the weights went live (a sample tagged new, drawn on old weights); an aborted request id kept
forever (a reused id aborted at once, and the set growing without bound); a safetensors header naming a key
twice accepted. Run: pytest tests/test_server_values.py -q
"""
from __future__ import annotations

import os

import pytest
import torch

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.server.engine import RolloutEngine, parse_sampling
from nanoflash.server.http import serve
from nanoflash.sglang.buckets import decode_blob, encode_blob, encode_tensors
from nanoflash.sglang.client import RequestRejected, SGLangClient


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny forwards, one thread


@pytest.fixture(scope="module")
def served():
    engine = RolloutEngine(Transformer(preset("tiny")).init_weights(0), weights="fp32", decode="full")
    httpd, url = serve(engine)
    yield engine, SGLangClient(url, retry_s=0.0), url
    httpd.shutdown()
    httpd.server_close()


def _named(engine, suffix):
    return next(n for n in engine.store.params if n.endswith(suffix))


def _push(client, url, named):
    return client.post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [encode_tensors(named)],
                                                            "load_format": "nanoflash_safetensors"})


def test_non_finite_or_out_of_range_updates_are_refused(served):
    engine, client, url = served
    norm, table = _named(engine, "input_layernorm.weight"), _named(engine, "tid2eid")
    good_norm, good_table = engine.store.params[norm].clone(), engine.store.params[table].clone()
    try:
        for name, bad, why in ((norm, good_norm.clone().fill_(float("nan")), "NaN/inf"),
                               (norm, torch.where(torch.arange(good_norm.numel()) == 3, float("inf"), good_norm), "NaN/inf"),
                               (table, good_table + engine.cfg.n_routed_experts, "outside")):
            with pytest.raises(RequestRejected, match=f"400.*{name}.*{why}"):
                _push(client, url, [(name, bad)])
            out = client.generate([3, 4], {"max_new_tokens": 2, "temperature": 0.0}, url=url)   # still serving
            assert out[0].finish_reason in ("stop", "length")
            engine.load([(name, good_norm if name == norm else good_table)])                  # undo the store
    finally:
        engine.load([(norm, good_norm), (table, good_table)])
        engine.post_process()


def test_health_generate_sees_an_inf_in_any_embedding_row(served):
    engine, client, url = served
    emb = engine.model.embed.weight
    row = emb.shape[0] - 1                                          # a token the health prompt never reads
    keep = emb.data[row].clone()
    try:
        emb.data[row, 0] = float("inf")
        with pytest.raises(RequestRejected, match="503.*non-finite weights"):
            client.get(url, "/health_generate")
    finally:
        emb.data[row] = keep
    client.get(url, "/health_generate")


def test_a_corrupt_disk_file_is_named(tmp_path):
    engine = RolloutEngine(Transformer(preset("tiny")).init_weights(0), weights="fp32", decode="full")
    httpd, url = serve(engine, disk_root=str(tmp_path))
    try:
        (tmp_path / "v1").mkdir()
        blob = bytearray(encode_blob([(_named(engine, "input_layernorm.weight"), torch.ones(64))]))
        (tmp_path / "v1" / "000_ok.safetensors").write_bytes(bytes(blob))
        (tmp_path / "v1" / "001_bad.safetensors").write_bytes(bytes(blob[:8]) + b"{not json" + bytes(blob[17:]))
        with pytest.raises(RequestRejected, match="001_bad.safetensors"):
            SGLangClient(url, retry_s=0.0).post(url, "/update_weights_from_disk",
                                                {"model_path": str(tmp_path / "v1")})
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_version_tag_follows_the_weights(served, monkeypatch):
    """A stock update with a weight_version: the tag may change only once post_process made the weights live
    (an unpaused generation between the two drew old weights under the new tag)."""
    engine, client, url = served
    seen, real = [], engine.post_process
    monkeypatch.setattr(engine, "post_process", lambda: (seen.append(engine.weight_version), real())[1])
    before = engine.weight_version
    name = _named(engine, "input_layernorm.weight")
    client.post(url, "/update_weights_from_tensor", {
        "serialized_named_tensors": [encode_tensors([(name, engine.store.params[name].clone())])],
        "load_format": "nanoflash_safetensors", "weight_version": "tagged-new"})
    assert seen == [before] and engine.weight_version == "tagged-new"
    engine.weight_version = before


def test_aborted_ids_are_forgotten_when_their_request_ends(served):
    engine, _, _ = served
    engine.abort(rid="never-sent")                       # an unknown id: a no-op, not kept forever
    assert engine.aborted == set()
    sp = parse_sampling({"max_new_tokens": 2, "temperature": 0.0}, engine.cfg.vocab_size)
    real, hit = engine._next_logits, []

    def abort_mid(seqs, state):                          # the client aborts it while it decodes
        if not hit:
            hit.append(engine.abort(rid="r1"))
        return real(seqs, state)
    engine._next_logits = abort_mid
    try:
        out = engine.generate([3, 4], sp, rid="r1")
    finally:
        del engine._next_logits
    assert out[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.aborted == set() and not engine.inflight
    again = engine.generate([3, 4], sp, rid="r1")        # the id reused: served, not aborted at once
    assert again[0]["meta_info"]["finish_reason"]["type"] != "abort"


def test_a_header_naming_a_key_twice_is_refused():
    blob = encode_blob([("a", torch.zeros(2)), ("b", torch.ones(2))])
    n = int.from_bytes(blob[:8], "little")
    header = blob[8:8 + n].decode()
    twice = header.replace('"b":', '"a":', 1)             # same length: the data offsets still match
    bad = blob[:8] + twice.encode() + blob[8 + n:]
    assert len(decode_blob(blob)) == 2
    with pytest.raises(ValueError, match="duplicate keys.*'a'"):
        decode_blob(bad)
