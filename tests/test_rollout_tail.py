"""Issue 41 items 1-3: a round's requests all in flight up to what the servers say they run, the tail aborted
once the step has its groups, partial samples discarded or carried into the next step.

A scripted client stands in for the servers (`Scripted`): a prompt is "fast" (answers at once) or "slow" (runs
until an abort reaches it, then answers with the tokens it had, finish_reason "abort", as SGLang 0.5.16 does);
its rewards are mixed (kept) or all 0 (dropped). The embedded server is checked for the same behaviour, and for
the capacity it reports and enforces.

Run: `pytest tests/test_rollout_tail.py -q`.
"""
import threading
import time
import types

import pytest
import torch

from nanoflash.config import RunConfig, preset
from nanoflash.model import Transformer
from nanoflash.rl import rounds
from nanoflash.rl.rounds import Carry, collect
from nanoflash.server.engine import RolloutEngine, parse_sampling
from nanoflash.server.http import RolloutServer
from nanoflash.sglang.client import Generation, SGLangClient

WAIT_S = 10.0   # a scripted slow request gives up waiting for its abort after this (the test then fails on counts)


class Scripted:
    """Requests by prompt position p (input_ids[0] = p + 1; a continuation carries more ids): p in `slow` runs
    until `abort_all`, then returns `partial` tokens with finish "abort"; otherwise it returns `length` tokens,
    finished. Token t of a response is 2 + t (never the stop id 1); log-probs -0.5 per token."""

    def __init__(self, slow=(), partial=1, length=3, together=0):
        self.slow, self.partial, self.length = set(slow), partial, length
        self.calls, self.aborts, self.weight_version = [], 0, None
        self.aborted, self.lock = threading.Event(), threading.Lock()
        self.together = threading.Barrier(together) if together else None   # that many requests run at once

    def generate(self, ids, sp, return_routed_experts=False):
        p, have = ids[0] - 1, len(ids) - 1
        with self.lock:
            self.calls.append((p, have, dict(sp)))
        if self.together is not None:
            self.together.wait(WAIT_S)
        n, left = sp["n"], sp["max_new_tokens"]
        if p in self.slow and not have:
            self.aborted.wait(WAIT_S)
            k = min(self.partial, left)
            return [Generation(ids, [2 + t for t in range(k)], [-0.5] * k, "abort") for _ in range(n)]
        k = min(self.length - have, left)
        return [Generation(ids, [2 + have + t for t in range(k)], [-0.5] * k, "length") for _ in range(n)]

    def abort_all(self, timeout=None):
        with self.lock:
            self.aborts += 1
        self.aborted.set()
        return [True]

    def sent(self) -> list:
        return sorted({p for p, have, _ in self.calls if not have})


def task(good):
    """Problems are their positions; a group of a `good` position gets rewards 0, 1, 0, 1, ... (kept), any other
    all 0 (dropped by dynamic sampling)."""
    return types.SimpleNamespace(train=list(range(1000)), encode=lambda p: [p + 1], stop_ids=[1],
                                 reward=lambda probs, outs: [float(probs[0] in good and i % 2) for i in range(len(outs))])


def config(G=2, n=2, chunk=6, partial=False, workers=0, max_new=3, staleness=1):
    cfg = RunConfig()
    cfg.grpo.n_prompts, cfg.grpo.group_size, cfg.grpo.over_sampling_batch_size = G, n, chunk
    cfg.rollout.max_workers, cfg.rollout.partial, cfg.rollout.max_rounds = workers, partial, 2
    cfg.rollout.max_new_tokens, cfg.rollout.max_staleness = max_new, staleness
    return cfg


MCFG = preset("tiny")


def test_the_tail_is_aborted_once_the_step_has_its_groups():
    """Bugs caught: the collector waiting for every request of the round (no abort: this test's slow requests
    never end), an abort before the step has its groups, and the counts of what was generated for what."""
    client = Scripted(slow={2, 3, 4, 5}, together=6)   # no answer until all six requests are in flight
    kept, seen, pos, c = collect(client, task({0, 1}), 0, config(), MCFG)
    assert [e.group_id for e in kept] == [0, 0, 1, 1] and pos == 6 and client.aborts >= 1
    assert client.sent() == [0, 1, 2, 3, 4, 5]                      # every prompt of the round in flight at once
    assert (c["samples_trained"], c["samples_generated"], c["samples_aborted"], c["tail_groups"]) == (4, 4, 8, 4)
    assert c["generated_per_trained"] == 1.0 and c["trained_groups"] == [0, 1] and c["partial_carried_groups"] == 0


def test_groups_are_kept_in_submission_order_not_completion_order():
    """Bug caught: results taken as they complete (Miles' asyncio.wait): the fast groups 1 and 2 would be kept
    over group 0, which is first in the data stream but slower -- short answers favoured, runs not replayable."""
    slow0 = Scripted(length=3)
    real = slow0.generate

    def generate(ids, sp, **kw):
        if ids[0] == 1:          # position 0 answers last
            time.sleep(0.3)
        return real(ids, sp, **kw)
    slow0.generate = generate
    kept, _, _, c = collect(slow0, task({0, 1, 2}), 0, config(chunk=3), MCFG)
    assert c["trained_groups"] == [0, 1]


def test_requests_not_yet_sent_are_never_sent():
    """With one request in flight (rollout.max_workers=1): group 0 is kept, group 1 runs, the rest wait in the
    pool. Bug caught: the pool left to drain its queue after the abort (every queued prompt generated)."""
    client = Scripted(slow={1, 2, 3, 4, 5})
    kept, _, pos, c = collect(client, task({0}), 0, config(G=1, workers=1), MCFG)
    assert c["trained_groups"] == [0] and pos == 6
    assert client.sent()[0] == 0 and len(client.sent()) <= 2, client.calls   # at most the one running when closed


def test_partial_rollouts_continue_the_tail_next_step_with_its_old_logprobs():
    """rollout.partial: the aborted groups go to the carry and are continued first in the next step, from their
    last token, with what is left of max_new_tokens; the carried tokens keep their log-probs and versions.
    Bugs caught: a continuation that restarts the sample (prompt only), one that asks for max_new_tokens again,
    log-probs of the carried tokens dropped, the carried share or the staleness not counted."""
    carry, client = Carry(), Scripted(slow={2, 3, 4, 5}, partial=1, length=3, together=6)
    cfg = config(partial=True, staleness=2)
    collect(client, task({0, 1, 2, 3}), 0, cfg, MCFG, carry=carry, at=1, version=0)
    assert [g.position for g in carry.groups] == [2, 3, 4, 5] and all(len(g.samples) == 2 for g in carry.groups)
    assert all(s.ids == [2] and s.finish is None and s.segments == [[0, 1, 1]] for g in carry.groups for s in g.samples)
    client.calls.clear()
    client.together = threading.Barrier(8)   # the eight continuations in flight at once
    kept, _, pos, c = collect(client, task({0, 1, 2, 3}), 6, cfg, MCFG, carry=carry, at=2, version=1)
    conts = [(p, have, sp) for p, have, sp in client.calls if have]
    assert sorted(p for p, _, _ in conts) == [2, 2, 3, 3, 4, 4, 5, 5] and not client.sent()   # no new prompt needed
    assert all(have == 1 and sp["n"] == 1 and sp["max_new_tokens"] == 2 for _, have, sp in conts)
    assert [e.group_id for e in kept] == [2, 2, 3, 3] and pos == 6
    assert all(e.response_ids == [2, 3, 4] and e.rollout_logprobs == [-0.5] * 3 for e in kept)
    assert c["partial_samples"] == 4 and c["partial_token_share"] == pytest.approx(1 / 3)
    assert (c["staleness_mean"], c["staleness_max"], c["staleness_1"]) == (1.0, 1, 4)   # (2 - 1) - oldest 0
    assert [g.position for g in carry.groups] == [4, 5]          # finished, not needed: carried again as they are


def test_carried_groups_past_max_staleness_are_dropped():
    """Bug caught: a group carried step after step trained on tokens of weights many pushes old."""
    carry, client = Carry(), Scripted(slow={1}, together=2)
    cfg = config(G=1, chunk=2, partial=True, staleness=1)
    collect(client, task({0, 1}), 0, cfg, MCFG, carry=carry, at=1, version=0)
    assert [g.position for g in carry.groups] == [1]
    kept, _, _, c = collect(Scripted(), task({0, 1, 2}), 2, cfg, MCFG, carry=carry, at=3, version=2)
    assert c["partial_dropped_stale"] == 1 and c["trained_groups"] == [2]   # (3 - 1) - 0 = 2 > 1


def test_the_carry_survives_a_checkpoint(tmp_path):
    """The carried groups are what a checkpoint adds to the data position: torch.save and a weights_only load
    (what dcp.load_file does) give them back. Bug caught: a carry that pickles its classes (refused on load)."""
    carry = Carry()
    collect(Scripted(slow={1}, together=2), task({0, 1}), 0, config(G=1, chunk=2, partial=True), MCFG, carry=carry,
            at=1, version=0)
    torch.save(carry.state_dict(), tmp_path / "c.pt")
    back = Carry()
    back.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True))
    assert back.state_dict() == carry.state_dict() and len(back) == 1 and back.groups[0].samples[0].ids == [2]


def test_adaptive_over_sampling_asks_for_what_the_keep_rate_needs():
    """grpo.adaptive_over_sampling: mean + 2 SD of the prompts needed at the keep rate seen, capped by the chunk.
    Bug caught: Miles' whole chunk for one missing group (the demo's second rounds: 16 prompts for 1 group)."""
    from nanoflash import grpo
    assert grpo.prompts_for_rate(32, 0.5, 512) == 80                  # (32 + 2 sqrt(16)) / 0.5
    assert grpo.prompts_for_rate(1, 0.97, 16) == 2 and grpo.prompts_for_rate(1, 1.0, 16) == 1
    assert grpo.prompts_for_rate(16, 0.1, 16) == 16 and grpo.prompts_for_rate(0, 0.5, 16) == 0
    cfg = config(G=2, chunk=6)
    cfg.grpo.adaptive_over_sampling = True
    client = Scripted(together=3)                                          # all three sent (then answered)
    collect(client, task(set(range(100))), 0, cfg, MCFG, history=(19, 20))   # rate p = (19 + 1) / (20 + 1)
    assert client.sent() == [0, 1, 2]                                       # (2 + 2 sqrt(2 (1 - p))) / p = 2.75


def test_inflight_is_the_flag_else_the_servers_capacity_over_n():
    rc = RunConfig().rollout
    assert rounds.inflight_requests(rc, 4096, 8) == 512 and rounds.inflight_requests(rc, None, 8) is None
    rc.max_workers = 3
    assert rounds.inflight_requests(rc, 4096, 8) == 3


@pytest.mark.parametrize("info,want", [
    ({"max_running_requests": None, "dp_size": 2, "internal_states": [
        {"effective_max_running_requests_per_dp": 1024}, {"effective_max_running_requests_per_dp": 1024}]}, 2048),
    ({"max_running_requests": 64, "dp_size": 2}, 128),
    ({"max_running_requests": None, "dp_size": 1}, None)])
def test_capacity_is_read_as_sglang_reports_it(info, want):
    """SGLang 0.5.16 `/server_info`: its ServerArgs (max_running_requests None unless set) and one internal state
    per DP rank with the scheduler's effective_max_running_requests_per_dp. Bugs caught: the flag read alone
    (None on a stock server), one DP rank's value taken for the server's."""
    client = SGLangClient(["http://a:1", "http://b:2"])
    client._info = {u: info for u in client.urls}
    assert client.max_running("http://a:1") == want
    assert client.capacity() == (None if want is None else 2 * want)


@pytest.fixture(scope="module")
def slow_engine():
    """The tiny model in the embedded engine with room for 2 running sequences, every decode step slowed."""
    mcfg = preset("tiny")
    engine = RolloutEngine(Transformer(mcfg).init_weights(0), weights="fp32", decode="full", max_running=2)
    real, engine.steps = engine._next_logits, 0

    def slow(seqs, state):
        engine.steps += 1
        time.sleep(0.05)
        return real(seqs, state)
    engine._next_logits = slow
    return engine


def test_embedded_server_queues_past_its_capacity_and_aborts_as_sglang(slow_engine):
    """The embedded server reports its capacity in /server_info as SGLang does, runs at most that many
    sequences (the rest wait in a queue), and an abort_all ends a queued request at once with no tokens and a
    running one with the tokens it has, scored. Bugs caught: no queue (every request decoding), a queued
    request not woken by the abort (it would run after), a running one returned without its log-probs."""
    engine, peak = slow_engine, [0]
    info = RolloutServer(engine).r_server_info({})
    assert info["max_running_requests"] == 2 and info["internal_states"][0]["effective_max_running_requests_per_dp"] == 2
    sp = parse_sampling({"n": 1, "max_new_tokens": 200, "temperature": 1.0, "stop_token_ids": [], "sampling_seed": 1},
                        engine.cfg.vocab_size)
    out = [None] * 3

    def run(i):
        out[i] = engine.generate([1, 2, 3], sp, rid=f"r{i}")
    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    t0 = time.monotonic()
    while engine.steps < 6 and time.monotonic() - t0 < WAIT_S:   # the two running ones past their first tokens
        peak[0] = max(peak[0], engine.running)
        time.sleep(0.005)
    engine.abort(abort_all=True)
    for t in threads:
        t.join(timeout=WAIT_S)
    assert peak[0] == 2 and engine.running == 0
    reasons = [o[0]["meta_info"]["finish_reason"] for o in out]
    assert [r["type"] for r in reasons] == ["abort"] * 3
    queued = [o[0] for o, r in zip(out, reasons) if r["message"] == "Abort in waiting queue"]
    running = [o[0] for o, r in zip(out, reasons) if r["message"] != "Abort in waiting queue"]
    assert len(queued) == 1 and queued[0]["output_ids"] == [] and len(running) == 2
    for o in running:
        assert 0 < len(o["output_ids"]) < 200 and len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"])
