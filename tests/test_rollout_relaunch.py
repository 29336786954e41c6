"""A trainer re-launched against running servers pushes again (issue 36, item 6).

The bug: a trainer that dies holding its update group (crash, SIGKILL, OOM) leaves the group registered on every
server; SGLang 0.5.16 refuses to init the same group name again (torch's _new_process_group_helper: "The specified
group name has already been created"), so the next launch fails until SGLang restarts. The embedded server now
refuses the same way; `Broadcaster` destroys a stale group of its name first (`clear_stale_group`).
Planted (in a copy): `clear_stale_group` a no-op -> the second launch's init gets HTTP 400 ("already exists").
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

import torch

from conftest import free_port
from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.sglang.client import RequestRejected, SGLangClient
from nanoflash.server.engine import RolloutEngine
from nanoflash.server.http import serve
from nanoflash.sglang.transports import Broadcaster, iter_sglang_buckets, push_weights

GROUP = "nanoflash-pp0"
# A spawned trainer imports torch and joins in a few seconds on the 2-core box; its join must end well before.
JOIN_TIMEOUT_S = 30.0


def _first_launch(url, port, joined):
    """A trainer that joins the group, says so, and then hangs until it is killed (never closes it)."""
    torch.set_num_threads(1)
    Broadcaster(SGLangClient(url), "127.0.0.1", port, backend="gloo", group_name=GROUP, timeout_s=JOIN_TIMEOUT_S)
    joined.set()
    signal.pause()


def test_second_launch_pushes_after_the_first_was_killed_holding_the_group():
    httpd, url = serve(RolloutEngine(Transformer(preset("tiny")).init_weights(1), weights="fp32"), tp_size=2)
    try:
        ctx = mp.get_context("spawn")
        joined = ctx.Event()
        first = ctx.Process(target=_first_launch, args=(url, free_port(), joined), daemon=True)
        first.start()
        assert joined.wait(JOIN_TIMEOUT_S + 30), "the first launch never joined"
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
        assert GROUP in httpd.rollout.groups                 # left behind, as a crash leaves it
        client = SGLangClient(url)
        try:   # the name is held: a plain init is refused, as SGLang 0.5.16 refuses it
            client.init_weights_update_group(url, "127.0.0.1", free_port(), 1, 3, GROUP, "gloo")
            raise AssertionError("a second init of a held group name was accepted")
        except RequestRejected as e:
            assert e.status == 400 and "already exists" in e.message
        trainer = Transformer(preset("tiny")).init_weights(0)
        bc = Broadcaster(client, "127.0.0.1", free_port(), backend="gloo", group_name=GROUP, timeout_s=JOIN_TIMEOUT_S)
        out = push_weights(client, iter_sglang_buckets(trainer, fp8=False, bucket_bytes=1 << 16), version=2,
                           transport="distributed", broadcaster=bc)
        assert out["verified"] == [(url, "checksums")]
        bc.close()
        assert GROUP not in httpd.rollout.groups
    finally:
        httpd.shutdown()
