"""SGLang client against small fake HTTP servers: protocol detection, retries, spreading, errors.

Run: `pytest tests/test_rollout_client.py -q`.
"""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nanoflash.rollout.client import (RequestRejected, ServerGoneError, SGLangClient, parse_generation,
                                      parse_version)


class Fake:
    """A canned SGLang look-alike: `routes` (None = no /openapi.json), `version`, records every call."""

    def __init__(self, routes=None, version="0.5.16"):
        self.routes, self.version, self.calls = routes, version, []
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.calls.append(("GET", self.path))
                if self.path == "/openapi.json" and fake.routes is not None:
                    return self._reply(200, {"paths": {p: {"post": {}} for p in fake.routes}})
                if self.path == "/get_server_info":
                    return self._reply(200, {"version": fake.version})
                if self.path == "/health":
                    return self._reply(200, {})
                self._reply(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.calls.append(("POST", self.path))
                if self.path == "/generate":
                    if body["input_ids"] == [0]:
                        return self._reply(400, {"error": {"message": "token 0 is not allowed"}})
                    n = body["sampling_params"].get("n", 1)
                    one = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length", "length": 2},
                           "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]], "weight_version": "1"}}
                    return self._reply(200, [one] * n if n > 1 else one)
                self._reply(404, {"detail": "Not Found"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("routes,version,want", [
    (["/generate", "/update_weights_from_tensor"], "0.5.16", "stock"),
    (["/generate", "/post_process_weights"], "0.5.12", "post_process"),
    (["/generate", "/begin_weight_update", "/end_weight_update"], "0.5.16", "session"),
    (None, "0.5.16.post1", "stock"),
    (None, "0.5.23", "session")])
def test_protocol_detection_uses_only_gets(routes, version, want):
    fake = Fake(routes, version)
    try:
        c = SGLangClient(fake.url, retry_s=1.0)
        assert c.protocol(fake.url) == want
        assert all(m == "GET" for m, _ in fake.calls), fake.calls  # detection has no side effects
    finally:
        fake.close()


def test_parse_version_and_generation_shapes():
    assert parse_version("0.5.16.post1") == (0, 5, 16) and parse_version("dev") == ()
    g = parse_generation({"output_ids": [3], "meta_info": {"output_token_logprobs": [[-1.0, 3, None]],
                                                          "finish_reason": {"type": "stop", "matched": 3}}}, [1], "u")
    assert g.output_ids == [3] and g.logprobs == [-1.0] and g.finish_reason == "stop"
    with pytest.raises(ValueError, match="disagree"):
        parse_generation({"output_ids": [4], "meta_info": {"output_token_logprobs": [[-1.0, 3, None]]}}, [1], "u")


def test_generate_goes_to_the_least_busy_server_and_4xx_is_not_retried():
    """The bug: `_pick` always returning the first url (every request of the loop's pool on one server)."""
    a, b = Fake(["/generate"]), Fake(["/generate"])
    try:
        c = SGLangClient([a.url, b.url], retry_s=0.3)
        with c._lock:
            c._inflight[a.url] += 1  # one request of the thread pool still running on a
        outs = [c.generate([1, 2], {"n": 2, "max_new_tokens": 2}) for _ in range(3)]
        assert all(len(o) == 2 and o[0].logprobs == [-0.5, -1.5] for o in outs)
        assert sum(p == "/generate" for _, p in a.calls) == 0 and sum(p == "/generate" for _, p in b.calls) == 3
        with c._lock:
            c._inflight[a.url] -= 1
        c.generate([1, 2], {"max_new_tokens": 2})  # a tie again: the first server
        assert sum(p == "/generate" for _, p in a.calls) == 1
        before = len(a.calls)
        with pytest.raises(RequestRejected, match="token 0 is not allowed"):
            c.generate([0], {}, url=a.url)
        assert len(a.calls) == before + 1  # rejected at once, never retried
    finally:
        a.close()
        b.close()


def test_gone_server_gives_clear_error_after_backoff():
    url = dead_url()
    c = SGLangClient(url, retry_s=0.4, backoff_s=0.05)
    with pytest.raises(ServerGoneError, match="unreachable after .* attempt") as err:
        c.generate([1, 2], {"max_new_tokens": 1})
    assert int(str(err.value).split("after ")[1].split(" attempt")[0]) > 1  # it backed off and retried
    with pytest.raises(ServerGoneError):
        c.wait_healthy(timeout=0.3)
