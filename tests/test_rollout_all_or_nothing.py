"""A refused weight update changes nothing: a request holding a valid tensor plus one named like a real tensor
but absent from this model (layers.99.*, an expert id past the last) is refused as a whole under every
protocol; the serving weights, the store and the protocol state stay exactly as before, and the next clean
update is accepted. (Before: the valid tensor went live, the bogus one stayed in the store, and every later
update failed until a restart.)

Run: pytest tests/test_rollout_all_or_nothing.py -q
"""
import pytest
import torch

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.sglang.client import RequestRejected, SGLangClient
from nanoflash.server.engine import RolloutEngine
from nanoflash.server.http import serve
from nanoflash.sglang.transports import SAFE_FORMAT, encode_tensors, iter_sglang_buckets, push_weights

PROMPT = [3, 17, 42, 9, 100, 5]


def _model(seed):
    return Transformer(preset("tiny")).init_weights(seed)


def _bogus(cfg):
    """(name, tensor) pairs that look real but this model has no place for."""
    E = cfg.n_routed_experts
    return [("layers.99.attn_norm.weight", torch.ones(cfg.dim)),
            (f"layers.1.ffn.experts.{E + 2}.w2.weight", torch.zeros(cfg.dim, cfg.moe_inter_dim))]


def _greedy(client):
    return client.generate(PROMPT, {"n": 1, "temperature": 0.0, "max_new_tokens": 6})[0].output_ids


@pytest.mark.parametrize("protocol", ["stock", "post_process", "session"])
def test_valid_plus_unknown_tensor_is_refused_whole_and_the_next_update_lands(protocol):
    engine = RolloutEngine(_model(0), weights="fp32")
    httpd, url = serve(engine, protocol=protocol)
    try:
        client = SGLangClient(url, retry_s=1.0)
        before_out, before_store = _greedy(client), dict(engine.store.checksums())
        before_model = {k: v.clone() for k, v in engine.model.state_dict().items()}
        other = _model(1)
        valid = list(iter_sglang_buckets(other, fp8=False, bucket_bytes=1 << 40))[0][:3]
        if protocol == "session":
            client.post(url, "/begin_weight_update", {})
        body = {"serialized_named_tensors": [encode_tensors(valid + _bogus(engine.cfg))], "load_format": SAFE_FORMAT}
        with pytest.raises(RequestRejected, match="400"):
            client.post(url, "/update_weights_from_tensor", body)
        if protocol == "session":
            client.post(url, "/end_weight_update", {})  # the session is still ours to close
        assert dict(engine.store.checksums()) == before_store
        for k, v in engine.model.state_dict().items():
            assert torch.equal(v, before_model[k]), k
        assert _greedy(client) == before_out
        push_weights(client, iter_sglang_buckets(other, fp8=False, bucket_bytes=64 << 10), version=1)
        assert engine.weight_version == "1" and _greedy(client) != before_out
        for k, v in other.state_dict().items():
            if not k.startswith("mtp."):  # the push skips MTP (rollouts do not use it)
                assert torch.equal(engine.model.state_dict()[k], v), k
    finally:
        httpd.shutdown()
