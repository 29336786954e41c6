"""A trainer killed mid-push leaves no server wedged (issue 39 item 2).

The bug: under the `session` protocol (SGLang >= 0.5.23's begin/end_weight_update; the embedded server's
`--protocol session`) a trainer killed between `/begin_weight_update` and `/end_weight_update` leaves the
session open and the server paused. Every later push -- the re-launched trainer's first -- got HTTP 400 "a
weight-update session is already open" and the run could not start until the server restarted. A pusher now
ends a stale session at start (`end_stale_session`; a 400 is the usual answer: none open) and continues
generation.

Run: pytest tests/test_rollout_stale_session.py -q
"""
from __future__ import annotations

from nanoflash.config import RolloutConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel.dims import ParallelDims
from nanoflash.server.engine import RolloutEngine
from nanoflash.server.http import serve
from nanoflash.sglang.client import SGLangClient
from nanoflash.sglang.push import StagePusher

BUCKET = 1 << 16  # 64 KiB: the tiny model's push is a few dozen buckets
GEN_TOKENS = 3    # generation after the re-launch: a few tokens prove the server is serving (not paused)


def test_relaunch_pushes_after_a_trainer_died_inside_an_update_session():
    httpd, url = serve(RolloutEngine(Transformer(preset("tiny")).init_weights(1), weights="fp32"),
                       protocol="session")
    try:
        dead = SGLangClient(url, retry_s=0.0)  # what a killed trainer left: paused, session open, no end
        dead.pause_generation("retract")
        dead.begin_update(url)
        assert httpd.rollout.session_open and httpd.rollout.engine.paused
        model = Transformer(preset("tiny")).init_weights(0)
        client = SGLangClient(url, retry_s=0.0)
        rc = RolloutConfig(weights="fp32", transport="tensor", bucket_bytes=BUCKET, sync_addr="127.0.0.1:1")
        pusher = StagePusher(ParallelDims(), client, rc, model.cfg, max_retries=0)
        assert not httpd.rollout.engine.paused, "a stale pause left at start: nothing generates until a push"
        info = pusher.push(lambda: model.state_dict().items(), version=3)  # the bug: "session is already open"
        assert info["version"] == 3 and set(info["verified"].values()) == {"checksums"}
        assert httpd.rollout.engine.weight_version == pusher.tag(3) and not httpd.rollout.session_open
        out = client.generate([1, 2, 3], {"max_new_tokens": GEN_TOKENS, "temperature": 0.0})
        assert len(out[0].output_ids) == GEN_TOKENS
    finally:
        httpd.shutdown()


def test_a_fresh_server_is_left_as_it_is():
    """Bug caught: the start-up clean-up failing on a server with no session open (its 400 is the usual answer),
    or opening a session of its own that the first push then trips over."""
    httpd, url = serve(RolloutEngine(Transformer(preset("tiny")).init_weights(1), weights="fp32"),
                       protocol="session")
    try:
        model = Transformer(preset("tiny")).init_weights(0)
        rc = RolloutConfig(weights="fp32", transport="tensor", bucket_bytes=BUCKET, sync_addr="127.0.0.1:1")
        pusher = StagePusher(ParallelDims(), SGLangClient(url, retry_s=0.0), rc, model.cfg, max_retries=0)
        assert not httpd.rollout.session_open and not httpd.rollout.engine.paused
        assert pusher.push(lambda: model.state_dict().items(), version=1)["version"] == 1
    finally:
        httpd.shutdown()
