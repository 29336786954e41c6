"""Mismatch tool: log-prob statistics and localization of the first diverging block, on planted bugs.

Run: `pytest tests/test_rollout_mismatch.py -q`.
"""
from __future__ import annotations

import pytest
import torch

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.sglang.client import SGLangClient
from nanoflash.server.engine import RolloutEngine
from instruments.mismatch import report, trace
from nanoflash.server.http import serve
from nanoflash.sglang.transports import iter_sglang_buckets, push_weights

PROMPTS = [[3, 17, 42, 9, 100, 5, 77, 8], [200, 1, 2, 3, 4, 5, 6, 7]]


def tiny():
    return Transformer(preset("tiny")).init_weights(0).eval()


@pytest.fixture(scope="module")
def setup():
    trainer = tiny()
    httpd, url = serve(RolloutEngine(tiny(), weights="fp32", decode="cache"))
    yield trainer, httpd.rollout.engine, SGLangClient(url, retry_s=1.0)
    httpd.shutdown()


def test_trace_reproduces_forward_bit_for_bit(setup):
    trainer = setup[0]
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(trace(trainer, ids)["logits"], trainer(ids))


def test_clean_engines_agree_exactly(setup):
    trainer, _, client = setup
    out = report(client, trainer, PROMPTS, max_new_tokens=8)
    assert out["mean"] == 0.0 and out["max"] == 0.0 and out["first_divergence"] is None


def test_planted_comb_untransposed_points_at_layer0_mixing(setup):
    trainer, engine, client = setup
    for blk in engine.model.layers.values():
        orig = blk.hc_pre
        blk.hc_pre = lambda h, fn, s, b, fused=False, orig=orig: (
            lambda x, p, c: (x, p, c.transpose(-1, -2)))(*orig(h, fn, s, b, fused))
    try:
        out = report(client, trainer, PROMPTS, max_new_tokens=8)
    finally:
        for blk in engine.model.layers.values():
            del blk.hc_pre
    print("\ncomb bug:", out)
    # all M streams are equal until layer 0's attention adds post-weighted output, so the transposed
    # (doubly stochastic) comb first matters at the FFN half's mixing
    assert out["mean"] > 0 and out["first_divergence"] == "layers.0.ffn.mix"


def test_planted_hash_ids_point_at_layer0_ffn(setup):
    trainer, engine, client = setup
    gate = engine.model.layers["0"].ffn.gate
    V = engine.cfg.vocab_size
    gate.forward = lambda x, ids, replay=None, orig=gate.forward: orig(x, (ids + 1) % V, replay)
    try:
        out = report(client, trainer, PROMPTS, max_new_tokens=8)
    finally:
        del gate.forward
    print("\nhash-id bug:", out)
    assert out["mean"] > 0 and out["first_divergence"] == "layers.0.ffn.out"


def test_unsynced_tid2eid_is_caught_by_checksums_and_localized(setup):
    trainer, _, client = setup
    g = torch.Generator().manual_seed(5)
    gate = trainer.layers["0"].ffn.gate
    gate.tid2eid.copy_(torch.randint(0, trainer.cfg.n_routed_experts, gate.tid2eid.shape, generator=g))
    forgot = [[(n, t) for n, t in b if "tid2eid" not in n]
              for b in iter_sglang_buckets(trainer, fp8=False, bucket_bytes=1 << 20)]
    with pytest.raises(RuntimeError, match="tid2eid"):
        push_weights(client, forgot, version=1)  # the verification refuses the push
    out = report(client, trainer, PROMPTS, max_new_tokens=8)
    print("\ntid2eid bug:", out)
    assert out["mean"] > 0 and out["first_divergence"] == "layers.0.ffn.out"


def test_mismatch_command_line_reports_json(setup, capsys):
    import json

    from instruments.mismatch import main
    _, _, client = setup
    main(["--url", client.urls[0], "--preset", "tiny", "--seed", "0", "--prompts", "2", "--max-new-tokens", "4"])
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 8 and set(out) >= {"mean", "p99", "max", "first_divergence"}
