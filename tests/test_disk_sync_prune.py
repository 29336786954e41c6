"""The disk transport keeps only the push the servers hold (issue 39 item 11).

The bug: every push of `rollout.transport=disk` wrote `{out}/sync/v{step}/pp{s}/` and none was ever deleted: a
run's disk grew by one full copy of the weights per step (284B parameters in FP8: ~300 GB a step). After a
verified push each source now deletes its stage's older pushes (`StagePusher._prune_disk`); a failed push
deletes nothing (the servers still hold the previous one).

Run: pytest tests/test_disk_sync_prune.py -q
"""
from __future__ import annotations

import os
import tempfile

import pytest

from nanoflash.config import RolloutConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel.dims import ParallelDims
from nanoflash.server.engine import RolloutEngine
from nanoflash.server.http import serve
from nanoflash.sglang.client import RequestRejected, SGLangClient
from nanoflash.sglang.push import StagePusher
from nanoflash.sglang.transports import PushFailed

BUCKET = 1 << 16  # 64 KiB: the tiny model's push is a few dozen bucket files
PUSHES = 3


def test_only_the_last_verified_push_stays_on_disk():
    with tempfile.TemporaryDirectory() as root:  # the server's disk_root must contain the pushes
        httpd, url = serve(RolloutEngine(Transformer(preset("tiny")).init_weights(1), weights="fp32"),
                           disk_root=root)
        try:
            sync = os.path.join(root, "sync")
            model = Transformer(preset("tiny")).init_weights(0)
            client = SGLangClient(url, retry_s=0.0)
            rc = RolloutConfig(weights="fp32", transport="disk", bucket_bytes=BUCKET, sync_addr="127.0.0.1:1")
            pusher = StagePusher(ParallelDims(), client, rc, model.cfg, disk_dir=sync, max_retries=0)
            for v in range(PUSHES):
                pusher.push(lambda: model.state_dict().items(), version=v)
                assert sorted(os.listdir(sync)) == [f"v{v}"], os.listdir(sync)  # the bug: v0, v1, v2
                assert os.listdir(os.path.join(sync, f"v{v}", "pp0"))
            real_post = client.post

            def refuse(u, path, body=None, **kw):
                if path == "/update_weights_from_disk":
                    raise RequestRejected(u + path, 500, "injected failure")
                return real_post(u, path, body, **kw)
            client.post = refuse
            with pytest.raises(PushFailed, match="injected failure"):
                pusher.push(lambda: model.state_dict().items(), version=PUSHES)
            assert f"v{PUSHES - 1}" in os.listdir(sync), "a failed push deleted the push the servers hold"
        finally:
            httpd.shutdown()
