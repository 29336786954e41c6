"""The embedded rollout server's HTTP layer, bounded: what a client can make it read, hold open, or wait for.

A rollout server listens for HTTP requests from trainers; a slow, broken or hostile client must not exhaust its
threads or memory, nor get past the API key. The rules, per connection and per request:

    connections   at most `max_connections` open at once; one more is answered 503 and closed at once
    reading       the request line and headers must arrive within `read_timeout_s` of the connection being
                  ready for a request (so an idle keep-alive connection is closed after `read_timeout_s`);
                  a body of n bytes within read_timeout_s + n / min_body_bytes_per_s. Every socket read
                  waits at most what is left of that deadline, so a client trickling one byte at a time is
                  cut (408) as surely as a silent one
    body size     Content-Length is required for a body, one decimal value, 0 <= n <= the route's limit
                  (`max_body` for every route but the weight payload `/update_weights_from_tensor`, which
                  gets `max_weight_body`); chunked bodies, a negative, non-numeric or oversized length are
                  refused (400 / 411 / 413) without reading the body, and a body that ends before n bytes
                  is refused (400); a refusal that leaves unread bytes closes the connection
    order         route, method and API key are checked before the body is read, so an unknown or
                  unauthorised client cannot make the server read (or allocate) its body
    the key       with an API key set, `Authorization: Bearer KEY` is compared in constant time
                  (`hmac.compare_digest`) on every route except `/health` and `/health_generate` -- SGLang's
                  own middleware exempts paths starting with /health (liveness probes) and no other;
                  without one, `LOCAL_ROUTES` (nanoflash's own `/nanoflash/trace`) answer loopback peers
                  only (403): a keyless server bound beyond loopback serves generation, not its activations
    JSON in       bare NaN / Infinity and nesting deep enough to exhaust the parser are malformed input: 400
    JSON out      `json.dumps(allow_nan=False)`; non-finite floats are written as null (what SGLang's orjson
                  responses do), never as the bare `NaN` that is not JSON

Shapes: make_handler(rollout_server, limits) -> a BaseHTTPRequestHandler class for `BoundedHTTPServer`.

Differs from SGLang: uvicorn has a keep-alive timeout (5 s) but no request-read deadline, and FastAPI reads any
body size; this stdlib server has both limits and no asyncio.

Tests: `pytest tests/test_rollout_http_limits.py -q`.
"""
from __future__ import annotations

import hmac
import io
import ipaddress
import json
import math
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from nanoflash.server.engine import BadRequest

WEIGHT_ROUTES = frozenset({"/update_weights_from_tensor"})  # base64 safetensors buckets: the large bodies
OPEN_ROUTES = frozenset({"/health", "/health_generate"})      # no key needed (SGLang: paths starting /health)
LOCAL_ROUTES = frozenset({"/nanoflash/trace"})                # without a key: loopback clients only


@dataclass
class HTTPLimits:
    """Per-connection and per-request bounds of the embedded server (see the module docstring)."""

    read_timeout_s: float = 30.0            # request line + headers (and idle keep-alive) deadline
    min_body_bytes_per_s: float = 1 << 20   # a body must arrive at >= 1 MiB/s on top of read_timeout_s
    max_connections: int = 256              # open connections, one thread each (4x the h200 recipe's 64 workers)
    max_body: int = 8 << 20                 # bytes, every route but the weight payload (a /generate batch)
    max_weight_body: int = 4 << 30          # bytes, /update_weights_from_tensor (1 GiB bucket, base64, TP copies)

    def __post_init__(self):
        if self.read_timeout_s <= 0 or self.min_body_bytes_per_s <= 0 or self.max_connections < 1 \
                or self.max_body < 0 or self.max_weight_body < 0:
            raise ValueError(f"HTTPLimits: timeouts and rates must be > 0, max_connections >= 1, body limits "
                             f">= 0; got {self}")


class HTTPError(Exception):
    """A request refused before it reached a route handler: status, message, and whether to close."""

    def __init__(self, status: int, message: str, close: bool = False):
        super().__init__(message)
        self.status, self.close = status, close


class DeadlineSocket(io.RawIOBase):
    """The connection's read side; every read waits at most until `owner.deadline` (then TimeoutError)."""

    def __init__(self, sock, owner):
        self.sock, self.owner = sock, owner

    def readable(self):
        return True

    def readinto(self, buf) -> int:
        left = self.owner.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request read deadline passed")
        self.sock.settimeout(left)
        return self.sock.recv_into(buf)


class BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most `max_connections` connections (threads) at once; the next is
    answered 503 from the accepting thread and closed."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int):
        self.slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            body = json.dumps({"error": {"message": f"too many connections (max {self.max_connections})"}})
            try:
                request.settimeout(1.0)
                request.sendall(f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode())
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def handle_error(self, request, client_address):
        """A client that went away (reset, or too slow to take its answer) is not a server error."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def finite_json(obj) -> bytes:
    """JSON bytes with non-finite floats written as null (never bare NaN / Infinity)."""
    try:
        return json.dumps(obj, allow_nan=False).encode()
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False).encode()


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _no_constant(name: str):
    raise BadRequest(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def parse_json(raw: bytes, path: str):
    """Request body -> object; malformed, NaN/Infinity or too deeply nested -> BadRequest (400)."""
    if not raw:
        return None
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise BadRequest(f"{path}: body is not valid JSON: {e}") from e
    except RecursionError as e:
        raise BadRequest(f"{path}: body is nested too deeply to parse") from e


def key_ok(api_key: str | None, path: str, auth: str | None) -> bool:
    """Constant-time check of `Authorization: Bearer KEY` (always true without a key and on OPEN_ROUTES)."""
    if not api_key or path in OPEN_ROUTES:
        return True
    return hmac.compare_digest((auth or "").encode(), f"Bearer {api_key}".encode())


def peer_ok(api_key: str | None, path: str, peer: str) -> bool:
    """LOCAL_ROUTES on a server without a key answer only loopback peers (127.0.0.0/8, ::1, v4-mapped)."""
    if api_key or path not in LOCAL_ROUTES:
        return True
    ip = ipaddress.ip_address(peer.split("%")[0])
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def body_length(headers, path: str, limit: int) -> int:
    """The declared body length, validated against `limit` (HTTPError otherwise)."""
    if headers.get("Transfer-Encoding"):
        raise HTTPError(411, f"{path}: Transfer-Encoding {headers['Transfer-Encoding']!r} is not supported; "
                             "send the body with a Content-Length", close=True)
    values = headers.get_all("Content-Length") or []
    if not values:
        return 0
    if len(set(values)) > 1 or not values[0].strip().isdigit():
        raise HTTPError(400, f"{path}: Content-Length {values} is not one non-negative integer", close=True)
    n = int(values[0])
    if n > limit:
        raise HTTPError(413, f"{path}: request body of {n} bytes exceeds this route's limit of {limit}",
                        close=True)
    return n


def make_handler(server, limits: HTTPLimits):
    """The request handler over a `server.RolloutServer` (`check(method, path)`, `handle(method, path, body)`)."""
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        deadline = 0.0

        def log_message(self, *args):  # keep test output quiet
            pass

        def setup(self):
            super().setup()
            self.rfile = io.BufferedReader(DeadlineSocket(self.connection, self))

        def handle_one_request(self):
            self.deadline = time.monotonic() + limits.read_timeout_s  # request line + headers (idle: closed)
            super().handle_one_request()

        def _reply(self, status: int, obj, close: bool = False):
            data = finite_json(obj)
            self.connection.settimeout(limits.read_timeout_s)  # a client that does not read its answer is cut
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _read_body(self, path: str) -> bytes:
            limit = limits.max_weight_body if path in WEIGHT_ROUTES else limits.max_body
            n = body_length(self.headers, path, limit)
            self.deadline = time.monotonic() + limits.read_timeout_s + n / limits.min_body_bytes_per_s
            try:
                raw = self.rfile.read(n) if n else b""
            except TimeoutError:
                raise HTTPError(408, f"{path}: the body did not arrive in time", close=True) from None
            if len(raw) != n:
                raise HTTPError(400, f"{path}: body ended after {len(raw)} of its {n} declared bytes", close=True)
            return raw

        def _serve(self, method: str):
            path, unread = self.path.split("?", 1)[0], bool(self.headers.get("Content-Length"))
            try:
                server.check(method, path)
                if not key_ok(server.api_key, path, self.headers.get("Authorization")):
                    raise HTTPError(401, f"{path} needs 'Authorization: Bearer <api key>'", close=True)
                if not peer_ok(server.api_key, path, self.client_address[0]):
                    raise HTTPError(403, f"{path} answers only loopback clients on a server started without "
                                         f"--api-key; start it with one to serve {path} to others", close=True)
                raw, unread = self._read_body(path), False
                status, out = server.handle(method, path, parse_json(raw, path))
                close = False
            except HTTPError as e:  # unread body bytes would be taken for the next request: close
                status, out, close = e.status, _error(str(e)), e.close or unread
            except (BadRequest, ValueError, KeyError, TypeError) as e:
                status, out, close = 400, _error(str(e)), False
            except Exception as e:  # the server must survive anything a request triggers
                status, out, close = 500, _error(f"{type(e).__name__}: {e}"), False
            self._reply(status, out, close)

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")
    return Handler


def _error(message: str) -> dict:
    return {"success": False, "message": message, "error": {"message": message}}
