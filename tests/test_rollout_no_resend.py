"""A POST that was sent is never sent again (issue 36, item 5).

The bug: `SGLangClient.request` treated a read timeout (600 s) like a refused connection and re-sent the POST:
a slow `/generate` was sampled twice (the first still running on the server), a slow
`/update_weights_from_distributed` was posted again and its second copy waited for a broadcast that never came.
A stub server that answers slowly and counts what it receives shows each POST arriving exactly once; a timed-out
generation is aborted on the server by its rid (SGLang's `/abort_request {"rid"}`), not re-sent; weight updates
read with their own, longer timeout. Planted (in a copy): the old retry of every error -> the count tests fail.
"""
from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest

from conftest import free_port
from nanoflash.sglang.client import RequestUnanswered, SGLangClient, ServerGoneError

# The client's read timeout in these tests, and how long the stub sleeps before answering a slow route: the stub
# must outlast the timeout by a margin that a loaded 2-core box cannot eat (a late answer would pass by luck).
READ_TIMEOUT_S = 0.5
SLOW_S = 2.5


class Stub(http.server.ThreadingHTTPServer):
    """Counts every request by path; sleeps SLOW_S on `slow` paths before answering {}."""

    daemon_threads = True

    def __init__(self, slow=()):
        self.slow, self.hits, self.bodies, self.lock = set(slow), {}, [], threading.Lock()
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _answer(self, body=None):
        srv = self.server
        with srv.lock:
            srv.hits[self.path] = srv.hits.get(self.path, 0) + 1
            srv.bodies.append((self.path, body))
        if self.path in srv.slow:
            time.sleep(SLOW_S)
        out = json.dumps({"output_ids": [1], "meta_info": {}} if self.path == "/generate" else {}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        except OSError:
            pass  # the client gave up on us

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        self._answer(json.loads(self.rfile.read(n) or b"{}"))

    def do_GET(self):
        self._answer()


@pytest.mark.parametrize("path", ["/generate", "/update_weights_from_distributed"])
def test_a_slow_post_is_sent_once(path):
    """The POST times out on the client and raises RequestUnanswered; the server saw it once, however long the
    client's retry budget (retry_s=30 would have re-sent it ~dozens of times)."""
    stub = Stub(slow={path})
    c = SGLangClient(stub.url, timeout=READ_TIMEOUT_S, update_timeout=READ_TIMEOUT_S, retry_s=30.0)
    t0 = time.monotonic()
    with pytest.raises(RequestUnanswered, match="not re-sent"):
        if path == "/generate":
            c.generate([1, 2, 3], {"max_new_tokens": 4, "n": 2})
        else:
            c.post(stub.url, path, {"names": ["w"], "group_name": "g"})
    assert time.monotonic() - t0 < SLOW_S + 5        # gave up at once, did not sit in backoff
    time.sleep(0.2)
    assert stub.hits[path] == 1
    stub.shutdown()


def test_a_timed_out_generation_is_aborted_by_its_rid():
    """n = 2: SGLang names the samples {rid}_0, {rid}_1 and ignores an abort of an rid it does not hold, so the
    abort names the request and each sample."""
    stub = Stub(slow={"/generate"})
    c = SGLangClient(stub.url, timeout=READ_TIMEOUT_S, retry_s=30.0)
    with pytest.raises(RequestUnanswered):
        c.generate([1, 2, 3], {"max_new_tokens": 4, "n": 2})
    rid = next(b["rid"] for p, b in stub.bodies if p == "/generate")
    aborted = [b["rid"] for p, b in stub.bodies if p == "/abort_request"]
    assert aborted == [rid, f"{rid}_0", f"{rid}_1"]
    assert stub.hits["/generate"] == 1
    stub.shutdown()


def test_updates_read_with_their_own_timeout():
    """A weight update slower than the generate timeout still returns: it waits update_timeout, not timeout."""
    stub = Stub(slow={"/update_weights_from_distributed"})
    c = SGLangClient(stub.url, timeout=READ_TIMEOUT_S, update_timeout=SLOW_S + 10)
    assert c.post(stub.url, "/update_weights_from_distributed", {"names": []}) == {}
    assert stub.hits["/update_weights_from_distributed"] == 1
    stub.shutdown()


def test_a_refused_connection_is_still_retried_then_named():
    """Nothing listening: nothing was sent, so the POST is retried until retry_s and the server named."""
    port = free_port()
    c = SGLangClient(f"http://127.0.0.1:{port}", retry_s=0.6, backoff_s=0.05)
    with pytest.raises(ServerGoneError, match=r"unreachable after [2-9]\d* attempt") as e:
        c.post(c.urls[0], "/generate", {"input_ids": [1]})
    assert not isinstance(e.value, RequestUnanswered)


def test_a_server_coming_up_late_gets_the_post_once():
    """Refused first, listening later: the POST (never sent while refused) lands exactly once."""
    port = free_port()
    c = SGLangClient(f"http://127.0.0.1:{port}", retry_s=10.0, backoff_s=0.05)
    holder = {}

    def start_later():
        time.sleep(0.5)
        srv = Stub.__new__(Stub)
        srv.slow, srv.hits, srv.bodies, srv.lock = set(), {}, [], threading.Lock()
        http.server.ThreadingHTTPServer.__init__(srv, ("127.0.0.1", port), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        holder["srv"] = srv
    threading.Thread(target=start_later, daemon=True).start()
    c.post(c.urls[0], "/update_weights_from_distributed", {"names": []})
    assert holder["srv"].hits == {"/update_weights_from_distributed": 1}
    holder["srv"].shutdown()
