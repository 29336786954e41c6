"""Server identity: samples are accepted only from the weight version the trainer last pushed and verified.

The fault: a rollout server killed and restarted on the same port serves its own initial weights; before this
check the trainer trained a whole step on its samples without a warning. A restart is simulated by the
embedded engine reporting its initial version again after a verified push.

Run: pytest tests/test_rollout_identity.py -q
"""
import pytest
import torch

from nanoflash.rl import collector
from nanoflash.cli import parse_args
from nanoflash.config import preset
from nanoflash.model import Transformer
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
