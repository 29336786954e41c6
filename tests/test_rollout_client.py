"""SGLang client against small fake HTTP servers: protocol detection, retries, spreading, errors.

Run: `pytest tests/test_rollout_client.py -q`.
"""
from __future__ import annotations

import socket

import pytest

from conftest import FakeSGLang as Fake
from nanoflash.sglang.client import (RequestRejected, ServerGoneError, SGLangClient, parse_generation,
                                      parse_version)


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
