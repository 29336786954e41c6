"""Client <-> embedded rollout server over real HTTP on localhost, tiny random model.

In-process servers (same process, same threads as the trainer) so fp32 log-probs can be compared for exact
equality ("true on-policy": difference 0.0). Run: `pytest tests/test_rollout_server.py -q`.
"""
from __future__ import annotations

import base64
import http.client
import json
import pickle
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.quant import dequantize_fp8_block, quantize_fp8_block
from nanoflash.sglang.client import RequestRejected, ServerGoneError, SGLangClient
from nanoflash.server.engine import RolloutEngine
from nanoflash.sglang.layout import sglang_fp8
from nanoflash.sglang.probe import prefill_logprobs
from nanoflash.server.http import serve
from nanoflash.sglang.transports import (Broadcaster, SAFE_FORMAT, encode_tensors, iter_sglang_buckets,
                                           probe_logprobs, push_weights, send_local_payload)

from conftest import free_port

PROMPT = [3, 17, 42, 9, 100, 5]
BF16_MEAN_DLOGP_BOUND = 0.01  # bf16 matmul weights vs fp32, same values: measured 1.1e-3 (fixed seeds)
FP8_MEAN_DLOGP_BOUND = 0.05  # tiny random model, FP8 128x128 weights + bf16 rest vs fp32: measured 1.4e-2 (fixed seeds)


def tiny(seed=0):
    return Transformer(preset("tiny")).init_weights(seed)


@torch.no_grad()
def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    for n, p in model.named_parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.02)


def buckets(model, fp8=False):
    return list(iter_sglang_buckets(model, fp8=fp8, bucket_bytes=64 << 10))


@pytest.fixture(scope="module")
def stock():
    trainer = tiny()
    httpd, url = serve(RolloutEngine(tiny(), weights="fp32"), protocol="stock",
                       disk_root=tempfile.gettempdir())  # the disk push below writes under tmp_path
    client = SGLangClient(url, retry_s=2.0)
    client.wait_healthy()
    yield trainer, client, httpd
    httpd.shutdown()


def trainer_logprobs(model, prompt, out, temperature):
    full = torch.tensor(list(prompt) + list(out))
    with torch.no_grad():
        return model.token_logprobs(full[None, :-1], full[None, 1:], temperature=temperature)[0, len(prompt) - 1:]


def test_generate_logprobs_equal_trainer_exactly(stock):
    trainer, client, _ = stock
    gens = client.generate(PROMPT, {"n": 3, "temperature": 0.8, "top_p": 0.9, "max_new_tokens": 10})
    assert len(gens) == 3 and all(len(g.output_ids) == 10 and g.finish_reason == "length" for g in gens)
    for g in gens:
        ref = trainer_logprobs(trainer, PROMPT, g.output_ids, 0.8)
        got = torch.tensor(g.logprobs, dtype=torch.float32)
        assert torch.equal(ref, got), (ref - got).abs().max()


def test_prefill_logprobs_score_given_tokens_as_the_trainer_and_match_decode(stock):
    """probe.prefill_logprobs (SGLang's logprob_start_len=0): the trainer's log-probs of every token after the
    first, for a batch of sequences of different lengths; on the embedded server (which scores its decode by a
    prefill too) equal to the rollout's output_token_logprobs bit for bit."""
    trainer, client, _ = stock
    g = client.generate(PROMPT, {"temperature": 0.8, "max_new_tokens": 7})[0]
    seqs = [list(PROMPT) + g.output_ids, [5, 9, 2]]
    got = prefill_logprobs(client, seqs, temperature=0.8)
    assert [len(x) for x in got] == [len(seqs[0]) - 1, 2]
    for x, lp in zip(seqs, got):
        assert torch.equal(torch.tensor(lp), trainer_logprobs(trainer, x[:1], x[1:], 0.8))
    assert got[0][len(PROMPT) - 1:] == g.logprobs
    one = client.post(client.urls[0], "/generate", {"input_ids": [5, 9, 2], "return_logprob": True,
                                                     "logprob_start_len": 1,
                                                     "sampling_params": {"max_new_tokens": 1, "temperature": 0.8}})
    lps = one["meta_info"]["input_token_logprobs"]   # from index 1, its value None, as SGLang's
    assert [t[1] for t in lps] == [9, 2] and lps[0][0] is None and lps[1][0] == got[1][1]
    got, out = _raw(client.urls[0], "POST", "/generate", json.dumps(
        {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": "0"}).encode())
    assert got == 400 and "logprob_start_len" in out["error"]["message"]


def test_stop_token_and_greedy_determinism(stock):
    _, client, _ = stock
    a = client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 6})[0]
    b = client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 6, "stop_token_ids": [a.output_ids[2]]})[0]
    first = a.output_ids.index(a.output_ids[2])
    assert b.output_ids == a.output_ids[:first + 1] and b.finish_reason == "stop"
    assert b.meta_info["finish_reason"]["matched"] == a.output_ids[2]


def test_push_tensor_changes_generation_and_stays_exact(stock):
    trainer, client, _ = stock
    before = probe_logprobs(client, trainer, PROMPT)
    assert before["max"] == 0.0
    perturb(trainer, 1)
    stats = push_weights(client, buckets(trainer), version=1, transport="tensor")  # verifies checksums
    assert stats["buckets"] > 1
    after = probe_logprobs(client, trainer, PROMPT)
    assert after["max"] == 0.0 and after["version"] == "1"
    assert after["tokens"] != before["tokens"] or after["mean"] != before["mean"]


def test_push_distributed_gloo_then_disk(stock, tmp_path):
    trainer, client, _ = stock
    perturb(trainer, 2)
    bc = Broadcaster(client, "127.0.0.1", free_port(), backend="gloo", group_name="t_dist")
    push_weights(client, buckets(trainer), version=2, transport="distributed", broadcaster=bc)
    assert probe_logprobs(client, trainer, PROMPT)["max"] == 0.0
    perturb(trainer, 3)
    push_weights(client, buckets(trainer), version=3, transport="disk", disk_dir=str(tmp_path / "w"))
    probe = probe_logprobs(client, trainer, PROMPT)
    assert probe["max"] == 0.0 and probe["version"] == "3"


def test_push_local_hands_tensors_in_process_and_refuses_a_foreign_handle(stock):
    """transport=local: the same verified push with a handle instead of bytes; the store then holds the values
    sent (checksums equal the tensor transport's); a handle this process never parked is a 400 that changes
    nothing, and a URL that is not an embedded server is refused before anything is sent."""
    trainer, client, httpd = stock
    perturb(trainer, 5)
    stats = push_weights(client, buckets(trainer), version=5, transport="local")  # verifies checksums
    assert stats["verified"] and probe_logprobs(client, trainer, PROMPT)["max"] == 0.0
    assert client.weights_checksums(client.urls[0]) == stats["checksums"]
    before = httpd.rollout.engine.store.checksums()
    status, body = _raw(client.urls[0], "POST", "/update_weights_from_tensor",
                        json.dumps({"load_format": "nanoflash_in_process", "handle": "0" * 32}).encode())
    assert status == 400 and "in-process payload" in body["error"]["message"]
    assert httpd.rollout.engine.store.checksums() == before
    other = SGLangClient(client.urls[0], retry_s=2.0)
    other.is_embedded = lambda url: False  # what a real SGLang server reports
    with pytest.raises(ValueError, match="transport=local"):
        send_local_payload(other, buckets(trainer)[0], None)
    assert httpd.rollout.engine.store.checksums() == before
    sums = client.post(client.urls[0], "/weights_checker", {"action": "checksum", "derived": True})["ranks"][0]
    assert sums["derived_checksum"] == httpd.rollout.engine.derived_checksum()


def test_tid2eid_buffer_is_pushed(stock):
    trainer, client, httpd = stock
    gate = trainer.layers["0"].ffn.gate
    gate.tid2eid.copy_(torch.flip(gate.tid2eid, dims=[0]))  # a different hash table
    served = httpd.rollout.engine.model.layers["0"].ffn.gate.tid2eid
    assert not torch.equal(served, gate.tid2eid)
    push_weights(client, buckets(trainer), version=4)
    assert torch.equal(served, gate.tid2eid)  # the buffer the server routes with is the pushed one
    assert probe_logprobs(client, trainer, PROMPT)["max"] == 0.0
    sums = client.weights_checksums(client.urls[0])
    assert "model.layers.0.mlp.topk.tid2eid" in sums


def _raw(url, method, path, body: bytes | None):
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = (r.status, json.loads(r.read() or b"{}"))
    conn.close()
    return out


def test_malformed_requests_get_4xx_and_server_keeps_serving(stock):
    trainer, client, _ = stock
    url = client.urls[0]
    pickled = base64.b64encode(pickle.dumps([("x", torch.zeros(1))])).decode()
    cases = [
        ("POST", "/generate", b"{not json", 400, "not valid JSON"),
        ("POST", "/generate", json.dumps({"input_ids": [1, 99999]}).encode(), 400, "/generate: input_ids"),
        ("POST", "/nanoflash/trace", json.dumps({"input_ids": []}).encode(), 400, "/nanoflash/trace: input_ids"),
        ("POST", "/generate", json.dumps({"input_ids": [1], "sampling_params": {"temprature": 1}}).encode(), 400,
         "temprature"),
        ("POST", "/generate", json.dumps({"input_ids": [1], "sampling_params": {"top_p": 0}}).encode(), 400, "top_p"),
        ("POST", "/update_weights_from_tensor", json.dumps({"serialized_named_tensors": [pickled],
                                                             "load_format": "flattened_bucket"}).encode(), 400,
         "never unpickles"),
        ("POST", "/update_weights_from_tensor", json.dumps({"serialized_named_tensors": [pickled],
                                                             "load_format": SAFE_FORMAT}).encode(), 400, "pickle"),
        ("POST", "/update_weights_from_tensor", json.dumps({"serialized_named_tensors": [encode_tensors(
            [("model.layers.1.self_attn.wq_a.weight", torch.zeros(32, 64))])], "load_format": SAFE_FORMAT}).encode(),
         400, "atomic pair"),
        ("POST", "/update_weights_from_tensor", json.dumps({"serialized_named_tensors": [encode_tensors(
            [("model.layers.9.nothing.weight", torch.zeros(2))])], "load_format": SAFE_FORMAT}).encode(), 400,
         "not a DeepSeek-V4"),
        ("POST", "/update_weights_from_distributed", json.dumps({"names": ["a"]}).encode(), 400, "group_name"),
        ("GET", "/generate", None, 405, "POST"),
        ("GET", "/begin_weight_update", None, 404, "no route"),
    ]
    for method, path, body, status, text in cases:
        got, out = _raw(url, method, path, body)
        assert got == status, (path, got, out)
        assert text in out["error"]["message"], (text, out)
    # a rejected split pair must not have changed anything the engine runs with
    push_weights(client, buckets(trainer), version=5)
    assert probe_logprobs(client, trainer, PROMPT)["max"] == 0.0


def test_session_protocol_order_is_enforced_and_api_key_required():
    trainer = tiny()
    httpd, url = serve(RolloutEngine(tiny(), weights="fp32", decode="cache"), protocol="session", api_key="k")
    try:
        anon = SGLangClient(url, retry_s=1.0)
        with pytest.raises(RequestRejected, match="401"):  # with a key set, every route but /health* needs it
            anon.protocol(url)
        with pytest.raises(RequestRejected, match="401"):
            anon.pause_generation()
        client = SGLangClient(url, api_key="k", retry_s=1.0)
        assert client.protocol(url) == "session"
        body = {"serialized_named_tensors": [encode_tensors(buckets(trainer)[0])], "load_format": SAFE_FORMAT}
        with pytest.raises(RequestRejected, match="outside a weight-update session"):
            client.post(url, "/update_weights_from_tensor", body)
        with pytest.raises(RequestRejected, match="without /begin_weight_update"):
            client.post(url, "/end_weight_update", {})
        perturb(trainer, 7)
        push_weights(client, buckets(trainer), version=1)
        assert probe_logprobs(client, trainer, PROMPT)["max"] == 0.0
    finally:
        httpd.shutdown()


@torch.no_grad()
def fp8_reference(model):
    """What an FP8 engine computes with, built by hand: dequant(quant(W)) where SGLang serves FP8, the
    pushed dtype (bf16/fp32) elsewhere, all held in the model's fp32."""
    ref = tiny()
    ref.load_state_dict(model.state_dict())
    kinds = {n: t.dtype for b in buckets(model, fp8=True) for n, t in b}  # dtype each tensor travels in
    from nanoflash.sglang.layout import to_sglang
    for n, t in ref.state_dict().items():
        if n.startswith("mtp."):
            continue
        if sglang_fp8(n, model.cfg):
            t.copy_(dequantize_fp8_block(*quantize_fp8_block(t, fmt="fp32"), torch.float32))
        elif t.is_floating_point():
            t.copy_(t.to(kinds[to_sglang(n)]).float())
    return ref


def test_fp8_mode_bounded_and_stale_post_process_is_caught():
    trainer = tiny()
    httpd, url = serve(RolloutEngine(tiny(), weights="fp8", decode="cache"), protocol="post_process")
    try:
        client = SGLangClient(url, retry_s=1.0)
        perturb(trainer, 11)
        push_weights(client, buckets(trainer, fp8=True), version=1)
        exact = probe_logprobs(client, fp8_reference(trainer), PROMPT)
        vs_trainer = probe_logprobs(client, trainer, PROMPT)
        print(f"\nFP8 mode vs fp32 trainer: mean |dlogp| {vs_trainer['mean']:.2e}, max {vs_trainer['max']:.2e}")
        assert exact["max"] == 0.0
        assert 0.0 < vs_trainer["mean"] < FP8_MEAN_DLOGP_BOUND
        # an update whose post-process step is skipped: the bytes land, the derived weights go stale
        perturb(trainer, 12)
        client.end_update = lambda url: None
        push_weights(client, buckets(trainer, fp8=True), version=2)  # checksums of the held bytes pass
        stale = probe_logprobs(client, fp8_reference(trainer), PROMPT)
        assert stale["max"] > 0.0  # ... and the behavioural probe catches the stale derived state
        client.post(url, "/post_process_weights", {"post_process_quantization": True})
        assert probe_logprobs(client, fp8_reference(trainer), PROMPT)["max"] == 0.0
    finally:
        httpd.shutdown()


def _start(port):
    cmd = [sys.executable, "-m", "nanoflash.server.http", "--preset", "tiny", "--port", str(port),
           "--threads", "1"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_killed_server_gives_clear_error_and_client_recovers():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(port)
    try:
        client = SGLangClient(url, retry_s=1.0, backoff_s=0.05)
        client.wait_healthy(timeout=120)
        errors = []

        def rollout():
            try:
                client.generate(PROMPT, {"max_new_tokens": 240, "temperature": 1.0})
            except Exception as e:  # the point of the test: what the rollout sees
                errors.append(e)
        th = threading.Thread(target=rollout)
        th.start()
        time.sleep(0.5)  # let the request reach the decode loop
        proc.kill()
        proc.wait()
        th.join()
        assert len(errors) == 1 and isinstance(errors[0], ServerGoneError), errors
        # sent before the kill: not re-sent (issue 36), the error names the server and says so
        assert url in str(errors[0]) and "not re-sent" in str(errors[0])
        proc = _start(port)  # the server comes back on the same address
        client.wait_healthy(timeout=120)
        g = client.generate(PROMPT, {"max_new_tokens": 4})[0]
        assert len(g.output_ids) == 4 and len(g.logprobs) == 4
    finally:
        proc.kill()
        proc.wait()


def test_routed_experts_r3_record_matches_trainer_routing(stock):
    trainer, client, _ = stock
    from nanoflash.sglang.client import decode_routed_experts
    g = client.generate(PROMPT, {"max_new_tokens": 5}, return_routed_experts=True)[0]
    cfg = trainer.cfg
    rx = decode_routed_experts(g.meta_info, cfg.n_layers, cfg.n_activated_experts)
    full = torch.tensor(PROMPT + g.output_ids)
    assert rx.shape == (len(full) - 1, cfg.n_layers, cfg.n_activated_experts)
    with torch.no_grad():
        trainer(full[None, :-1])
    want = torch.stack([trainer.layers[k].ffn.last_indices for k in sorted(trainer.layers, key=int)], 1)
    assert torch.equal(rx, want)


def test_pause_in_place_holds_requests_and_abort_ends_them(stock):
    trainer, client, _ = stock
    results = {}

    def run(key, n_tokens):
        results[key] = client.generate(PROMPT, {"max_new_tokens": n_tokens})[0]
    client.pause_generation("in_place")
    held = threading.Thread(target=run, args=("held", 3))
    held.start()
    held.join(timeout=1.0)
    assert held.is_alive()  # waits at a step boundary while paused
    client.continue_generation()
    held.join()
    assert len(results["held"].output_ids) == 3 and results["held"].finish_reason == "length"
    long = threading.Thread(target=run, args=("long", 240))
    long.start()
    time.sleep(0.5)  # let it reach the decode loop
    client.abort_all()
    long.join()
    out = results["long"]
    assert out.finish_reason == "abort" and len(out.output_ids) < 240
    ref = trainer_logprobs(trainer, PROMPT, out.output_ids, 1.0)  # the partial sample is still scored exactly
    assert torch.equal(ref, torch.tensor(out.logprobs, dtype=torch.float32))


def test_bf16_engine_matches_bf16_trainer_exactly_and_fp32_within_bound():
    trainer = tiny().cast_(torch.bfloat16)
    httpd, url = serve(RolloutEngine(tiny().cast_(torch.bfloat16), weights="bf16", decode="cache"))
    try:
        client = SGLangClient(url, retry_s=1.0)
        perturb(trainer, 21)
        push_weights(client, buckets(trainer))
        assert probe_logprobs(client, trainer, PROMPT, max_new_tokens=4)["max"] == 0.0
        fp32 = tiny()
        fp32.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in trainer.state_dict().items()})
        d = probe_logprobs(client, fp32, PROMPT, max_new_tokens=4)
        print(f"\nbf16 engine vs fp32 trainer (same weights): mean |dlogp| {d['mean']:.2e}, max {d['max']:.2e}")
        assert d["mean"] < BF16_MEAN_DLOGP_BOUND
    finally:
        httpd.shutdown()
