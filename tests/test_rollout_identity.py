"""Server identity: samples are accepted only from the weight version the trainer last pushed and verified.

The fault: a rollout server killed and restarted on the same port serves its own initial weights; before this
check the trainer trained a whole step on its samples without a warning. A restart is simulated by the
embedded engine reporting its initial version again after a verified push.

Run: pytest tests/test_rollout_identity.py -q
"""
import dataclasses

import pytest
import torch

from nanoflash.rl import collector
from nanoflash.cli import parse_args
from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.parallel.dims import ParallelDims
from nanoflash.sglang.push import StagePusher
from nanoflash.sglang.transports import iter_sglang_buckets, push_weights


@pytest.fixture
def served():
    cfg = parse_args(["--recipe", "smoke", "--grpo.dynamic_sampling", "false", "--grpo.n_prompts", "2"])
    mcfg = preset("tiny", **cfg.model)
    model = Transformer(mcfg).init_weights(0)
    client, engines, httpds = collector.start_embedded(model, 1, "fp32", 0)
    task = collector.make_task(cfg.train, cfg.eval, mcfg.vocab_size)
    yield cfg, mcfg, model, client, engines[0], task
    for h in httpds:
        h.shutdown()


def _collect(cfg, mcfg, client, task):
    return collector.collect(client, task, 0, cfg, mcfg)


def test_samples_from_the_pushed_version_are_accepted_a_restarted_server_is_refused(served):
    cfg, mcfg, model, client, engine, task = served
    push_weights(client, iter_sglang_buckets(model, fp8=False, bucket_bytes=1 << 20), version=3)
    kept, seen, _, _ = _collect(cfg, mcfg, client, task)
    assert seen and engine.weight_version == "3"
    engine.weight_version = "0"  # what the same URL reports after a restart: its initial weights
    with pytest.raises(collector.StaleServerError, match=rf"{client.urls[0]} generated with weight version 0, but "
                                                  r"version 3 was pushed"):
        _collect(cfg, mcfg, client, task)


def test_servers_without_a_version_are_not_refused():
    gens = [type("G", (), {"weight_version": None, "server": "http://x"})()]
    collector.check_versions(gens, 4)  # an older protocol that reports nothing: nothing to compare
    with pytest.raises(collector.StaleServerError):
        collector.check_versions([type("G", (), {"weight_version": "2", "server": "http://x"})()], 4)


def test_a_server_restarted_right_after_the_first_push_is_refused(served):
    """Issue 39 item 3. Bug caught: the first push is version 0 (step 0), which is also what a fresh server
    reports, so a server restarted between the first push and step 1 passed the check and step 1 trained on
    its initial weights. The pusher's versions carry a launch nonce (`StagePusher.tag`)."""
    cfg, mcfg, model, client, engine, task = served
    rc = dataclasses.replace(cfg.rollout, transport="tensor", weights="fp32", sync_addr="127.0.0.1:1")
    pusher = StagePusher(ParallelDims(), client, rc, mcfg, max_retries=0)
    pusher.push(lambda: model.state_dict().items(), version=0)   # train.py's first push: version = step = 0
    _collect(cfg, mcfg, client, task)                              # its samples are accepted
    assert engine.weight_version == client.weight_version == pusher.tag(0) != "0"
    engine.weight_version = "0"  # the same URL after a restart: its initial weights, its initial version
    with pytest.raises(collector.StaleServerError, match=r"generated with weight version 0, but version 0-"):
        _collect(cfg, mcfg, client, task)


def test_two_launches_never_share_a_version():
    """Bug caught: a nonce drawn from the seeded torch/python generators (every launch of a run the same)."""
    rc = parse_args(["--recipe", "smoke"]).rollout
    a, b = (StagePusher(ParallelDims(), _NoServers(), rc, preset("tiny")) for _ in range(2))
    assert a.tag(3) != b.tag(3) and a.tag(3).startswith("3-")


class _NoServers:
    urls, api_key = [], None

    def is_embedded(self, url):
        return True
