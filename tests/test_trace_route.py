"""`/nanoflash/trace` is bounded and not open to the world (issue 39 case 8).

Bugs caught: 4,000 ids gave a 76 MB answer (an 8 MiB body could ask for ~75 GB: the route had no bound on ids
or on the answer); a server started without a key served every layer's activations to anyone who could reach
it. Now: at most max_seq_len ids (400), an answer of at most `max_trace_bytes` (413, computed before any
forward by `trace.answer_bytes`, an upper bound checked here against real answers), and without a key only
loopback clients (403); with a key, the key (401 otherwise: tests/test_rollout_http_limits.py).
Run: pytest tests/test_trace_route.py -q
"""
from __future__ import annotations

import http.client
import json
import socket

import pytest

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.server.engine import RolloutEngine
from nanoflash.server.http import serve
from nanoflash.server.trace import answer_bytes

KEY = "trace-key"
N_FIT = 3   # the test server's max_trace_bytes holds the answer for this many ids, not one more


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny forwards, one thread


@pytest.fixture(scope="module")
def engine():
    return RolloutEngine(Transformer(preset("tiny")).init_weights(0), weights="fp32", decode="full")


def post(host, port, ids, key=None):
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("POST", "/nanoflash/trace", body=json.dumps({"input_ids": ids}),
                 headers={"Authorization": f"Bearer {key}"} if key else {})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    return r.status, raw


def lan_address() -> str | None:
    """This host's address on its first non-loopback route (a UDP socket's local end; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))   # TEST-NET-1: a route is picked, no packet leaves
            return None if s.getsockname()[0].startswith("127.") else s.getsockname()[0]
        except OSError:
            return None


def test_ids_and_answer_bytes_are_bounded(engine):
    model = engine.model
    httpd, url = serve(engine, max_trace_bytes=answer_bytes(model, N_FIT))
    port = httpd.server_address[1]
    try:
        status, raw = post("127.0.0.1", port, list(range(1, N_FIT + 1)))
        assert status == 200 and len(raw) <= answer_bytes(model, N_FIT)     # the bound holds for a real answer
        assert len(raw) > 0.9 * answer_bytes(model, N_FIT)                  # and is not loose
        status, raw = post("127.0.0.1", port, list(range(1, N_FIT + 2)))
        assert status == 413 and f"trace at most {N_FIT} ids" in json.loads(raw)["error"]["message"]
        status, raw = post("127.0.0.1", port, [1] * (model.cfg.max_seq_len + 1))
        assert status == 400 and f"max_seq_len={model.cfg.max_seq_len}" in json.loads(raw)["error"]["message"]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_without_a_key_only_loopback_clients_are_answered(engine):
    lan = lan_address()
    if lan is None:
        pytest.skip("this host has no non-loopback address to call from")
    for key in (None, KEY):
        httpd, _ = serve(engine, host="0.0.0.0", api_key=key)
        port = httpd.server_address[1]
        try:
            assert post("127.0.0.1", port, [1, 2], key)[0] == 200
            status, raw = post(lan, port, [1, 2], key)
            if key is None:
                assert status == 403 and "loopback" in json.loads(raw)["error"]["message"]
                assert post(lan, port, [1, 2])[0] == 403
            else:
                assert status == 200 and post(lan, port, [1, 2])[0] == 401
        finally:
            httpd.shutdown()
            httpd.server_close()
