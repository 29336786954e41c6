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


def test_routing_records_are_compact_and_dropped_with_their_group():
    """Bugs caught (issue 37): R3 records kept as int64 [T, n_layers, K] for every sample seen (~24 GiB a round
    on rank 0 at flash scale), and kept for groups dynamic sampling dropped. The ids must survive exactly."""
    import base64
    import types

    import numpy as np
    import torch

    from nanoflash.rl.collector import _episodes, expert_id_dtype
    from nanoflash.sglang.client import Generation
    assert expert_id_dtype(256) == torch.uint8 and expert_id_dtype(257) == torch.int16
    assert expert_id_dtype(40_000) == torch.int32
    ids = np.array([[[0, 255], [7, 200]], [[3, 4], [250, 1]]], dtype=np.int32)            # [T=2, layers=2, K=2]
    meta = {"routed_experts": base64.b64encode(ids.tobytes()).decode()}
    gens = [Generation([1, 2], [5], [-0.1], "stop", meta_info=meta)]

    class _Task:
        reward = staticmethod(lambda probs, outs: [1.0] * len(outs))
    (ep,) = _episodes(gens, [1, 2], 0, _Task, None, types.SimpleNamespace(n_layers=2, n_activated_experts=2,
                                                                            n_routed_experts=256))
    assert ep.routed_experts.dtype == torch.uint8 and ep.routed_experts.tolist() == ids.tolist()


def test_collect_drops_the_routing_records_of_dropped_groups():
    """A group whose rewards are all equal is dropped by dynamic sampling; its episodes stay in the metrics
    (`seen`) without their R3 records; kept groups keep theirs."""
    import base64

    import numpy as np

    from nanoflash.rl.collector import collect
    from nanoflash.sglang.client import Generation
    mcfg = preset("tiny")
    K, L = mcfg.n_activated_experts, mcfg.n_layers
    rec = {"routed_experts": base64.b64encode(np.zeros((2, L, K), np.int32).tobytes()).decode()}

    class _Client:
        weight_version = None

        def generate(self, ids, sp, return_routed_experts=False):
            return [Generation(ids, [5], [-0.1], "stop", meta_info=rec) for _ in range(sp["n"])]
    task, cfg = _same_and_mixed(routing_replay=True)
    kept, seen, _, _ = collect(_Client(), task, 0, cfg, mcfg)
    assert len(seen) == 4 and len(kept) == 2
    assert all(e.routed_experts is not None for e in kept)
    assert all(e.routed_experts is None for e in seen if all(e is not k for k in kept))
def test_collect_asks_for_keeps_and_drops_the_indexer_records():
    """With `rollout.indexer_replay` every request asks for `return_indexer_topk`; each kept episode carries
    its record (SGLang's base64 int32 [T-1, n_c4, K], stored entry + 1), a group dynamic sampling drops loses
    it, and a server that sends none stops the step with one error naming the server option; a record that
    cannot be the sequence's (an entry its query cannot see) is refused where it enters, named."""
    import base64

    import numpy as np

    from nanoflash.rl.collector import collect
    from nanoflash.sglang.client import Generation
    mcfg = preset("tiny")
    T, K = 2, mcfg.index_topk                                    # prompt [1, 2] + one token: 2 positions
    kept_entries = np.full((T, 2, K), -1, np.int32)
    rec = {"indexer_topk": base64.b64encode(kept_entries.tobytes()).decode()}
    asked = []

    class _Client:
        weight_version = None

        def __init__(self, meta):
            self.meta = meta

        def generate(self, ids, sp, return_routed_experts=False, return_indexer_topk=False):
            asked.append(return_indexer_topk)
            return [Generation(ids, [5], [-0.1], "stop", meta_info=dict(self.meta))
                    for _ in range(sp["n"])]
    task, cfg = _same_and_mixed(indexer_replay=True)
    kept, seen, _, _ = collect(_Client(rec), task, 0, cfg, mcfg)
    assert asked and all(asked) and len(seen) == 4 and len(kept) == 2
    for e in kept:
        assert e.indexer_topk.dtype == torch.int16 and torch.equal(e.indexer_topk.long() - 1,
                                                                   torch.from_numpy(kept_entries).long())
    assert all(e.indexer_topk is None for e in seen if all(e is not k for k in kept))
    with pytest.raises(RuntimeError, match=r"sent no indexer_topk record: SGLang needs --enable-return-indexer-topk"):
        collect(_Client({}), task, 0, cfg, mcfg)
    kept_entries[1, 0, 0] = 5                                 # query 1 sees no entry: another sequence's record
    wrong = {"indexer_topk": base64.b64encode(kept_entries.tobytes()).decode()}
    with pytest.raises(ValueError, match=r"query 1 keeps an entry beyond its 0 visible ones"):
        collect(_Client(wrong), task, 0, cfg, mcfg)


def _same_and_mixed(**rollout):
    """A task of two prompts, "same" (every reward 0: dynamic sampling drops its group) and "mixed" (rewards
    alternate), and a run config of one prompt a step, groups of 2, one round, `rollout` fields set."""
    import types

    from nanoflash.config import RunConfig
    flips = iter(range(10 ** 6))
    task = types.SimpleNamespace(train=["same", "mixed"], encode=lambda p: [1, 2], stop_ids=[0],
                                 reward=lambda probs, outs: [0.0 if probs[0] == "same" else float(next(flips) % 2)
                                                             for _ in outs])
    cfg = RunConfig()
    cfg.grpo.n_prompts, cfg.grpo.group_size, cfg.grpo.over_sampling_batch_size = 1, 2, 2
    cfg.rollout.max_rounds = 1
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return task, cfg


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
