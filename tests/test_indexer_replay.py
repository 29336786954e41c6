"""Indexer replay: the rollout engine's C4 kept sets replace the lightning indexer's top-k in a training forward
(`Transformer.run_layers(indexed=)`, `model.replayed_entries`), as Miles' `--use-rollout-indexer-replay` does
with SGLang's `return_indexer_topk` record ([sequence length - 1, C4 layers, index_topk], -1 padded).

References: the model's own selection replayed changes nothing (bit for bit); another selection replayed is
exactly what the model computes when its indexer chooses that selection itself (`Indexer.top_k` replaced),
forward and backward; a record that cannot be this sequence's is refused, named.
"""
import pytest
import torch

import nanoflash.model as M
from nanoflash.config import preset
from nanoflash.model import Transformer, c4_layers, check_replay_record, replayed_entries

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny forwards, one thread

S = 48   # tiny: window 8, top-4 of (t + 1) // 4 entries -- the indexer selects from query 16 on


def own_selection(model, ids) -> torch.Tensor:
    """The entries each C4 layer's indexer keeps in one forward, as a replay record [B,S,n_c4,K] (-1 padded)."""
    kept = {}
    hooks = [mod.register_forward_hook(lambda m, a, out, name=name: kept.__setitem__(name, out[0]))
             for name, mod in model.named_modules() if isinstance(mod, M.Indexer)]
    with torch.no_grad():
        model.run_layers(model.embed_streams(ids), ids)
    for h in hooks:
        h.remove()
    K = model.cfg.index_topk
    out = []
    for name in sorted(kept, key=lambda n: int(n.split(".")[1])):
        mask = kept[name]                                                            # [B,S,C] bool
        idx = torch.where(mask, torch.arange(mask.shape[-1]), -1).sort(-1, descending=True).values
        out.append(torch.nn.functional.pad(idx, (0, max(0, K - idx.shape[-1])), value=-1)[..., :K])
    return torch.stack(out, 2)                                                       # [B,S,n_c4,K]


def _model():
    cfg = preset("tiny")
    return Transformer(cfg).init_weights(0).float()


def test_c4_layers_are_the_ratio_4_layers_in_order():
    cfg = preset("tiny")
    assert c4_layers(cfg) == [1, 3] == [i for i, r in enumerate(cfg.compress_ratios[:cfg.n_layers]) if r == 4]


def test_replaying_the_models_own_selection_changes_nothing(gen):
    """Bug caught: the replay applied to another C4 layer's slice, or read at a shifted query."""
    model = _model().eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, S), generator=gen)
    own = own_selection(model, ids)
    assert own.shape == (2, S, 2, model.cfg.index_topk) and (own[:, 20:] >= 0).all()
    with torch.no_grad():
        want = model.run_layers(model.embed_streams(ids), ids)
        got = model.run_layers(model.embed_streams(ids), ids, indexed=own + 1)          # stored entry + 1
        swapped = model.run_layers(model.embed_streams(ids), ids, indexed=own.flip(2) + 1)   # layers exchanged
    assert torch.equal(got, want)
    assert not torch.equal(swapped, want)


def test_replaying_another_selection_is_the_model_choosing_it(gen, monkeypatch):
    """A selection unlike the model's (one kept entry swapped for one it dropped, at several queries of both
    layers) gives exactly the outputs and gradients of the model whose indexer keeps that selection itself.
    Bug caught: a replayed entry dropped, an entry kept that the record does not hold, no gradient path."""
    model = _model().train()
    ids = torch.randint(0, model.cfg.vocab_size, (2, S), generator=gen)
    rec = own_selection(model, ids)
    for b, t, j in [(0, 30, 0), (1, 41, 1), (0, S - 1, 1)]:
        dropped = next(u for u in range((t + 1) // 4) if u not in rec[b, t, j].tolist())
        rec[b, t, j, 0] = dropped
    C = S // 4                                           # a C4 layer's entries over the whole sequence
    forced = {id(model.get_submodule(f"layers.{i}.attn.indexer")): replayed_entries(rec[:, :, j], C, 4, 0, False)
              for j, i in enumerate(c4_layers(model.cfg))}

    def loss_and_grads(**kw):
        model.zero_grad()
        h = model.run_layers(model.embed_streams(ids), ids, **kw)
        loss = model.logits(h).logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got, g_got = loss_and_grads(indexed=(rec + 1).to(torch.int16))
    with monkeypatch.context() as mp:                    # the indexer "chooses" the record's entries itself
        mp.setattr(M.Indexer, "top_k", lambda self, q, keys, w, start_pos: forced[id(self)])
        want, g_want = loss_and_grads()
    plain, _ = loss_and_grads()
    assert torch.equal(got, want) and not torch.equal(got, plain)
    assert g_got.keys() == g_want.keys()
    for n in g_got:
        assert torch.equal(g_got[n], g_want[n]), n


def test_replayed_entries_in_both_forms():
    """The record's entries in any order, -1 anywhere: the mask holds exactly them; the kernels' index list
    holds them first, -1 last, min(top-k, C) columns."""
    kept = torch.tensor([[[-1, 3, 0, -1], [2, -1, 1, 3]]])                 # [1,2,4]: queries at 15 and 16
    mask = replayed_entries(kept, 4, 4, 15, fast=False)                    # C = 4 entries, both see all 4
    assert mask.tolist() == [[[True, False, False, True], [False, True, True, True]]]
    lst = replayed_entries(kept, 4, 4, 15, fast=True)
    assert lst.dtype == torch.int32 and lst.tolist() == [[[3, 0, -1, -1], [3, 2, 1, -1]]]
    assert replayed_entries(kept, 4, 8, 15, fast=True).shape[-1] == 4      # min(top-k, C) columns


def test_a_record_that_cannot_be_this_sequences_is_refused():
    """An entry the query cannot see yet, or more entries than the top-k: one error naming query and layer."""
    rec = torch.full((20, 2, 2), -1)
    rec[16:, :, 0] = 3                                   # queries 16..19 see entries 0..3 (4 or 5 of them)
    check_replay_record(rec, 2)
    rec[15, 1, 1] = 4                                    # query 15 sees 0..3
    with pytest.raises(ValueError, match=r"query 15 keeps an entry beyond its 4 visible ones or more than top-2 in "
                                         r"C4 layer 1"):
        check_replay_record(rec, 2)
    with pytest.raises(ValueError, match=r"query 19 keeps an entry beyond its 5 visible ones or more than top-2"):
        check_replay_record(torch.tensor([[[-1, -1, -1]]] * 19 + [[[0, 1, 2]]]), 2)


def _replay_cfg(pp: int):
    from nanoflash.cli import parse_args
    return parse_args(["--recipe", "smoke", "--rollout.indexer_replay", "true", "--parallel.recompute", "true",
                       "--parallel.micro_batch_tokens", "40", "--parallel.pp", str(pp)])


def _replay_batch(mcfg, lengths=((6, 22), (5, 23), (4, 4), (3, 9)), seed=3):
    """Episodes of random tokens, each with a random indexer record (visible entries, -1 padded), packed."""
    from nanoflash import grpo
    g = torch.Generator().manual_seed(seed)
    K, n_c4 = mcfg.index_topk, len(c4_layers(mcfg))
    eps, recs = [], []
    for i, (P, R) in enumerate(lengths):
        ids = torch.randint(1, mcfg.vocab_size, (P + R,), generator=g).tolist()
        rec = torch.full((P + R - 1, n_c4, K), -1)
        for t in range(P + R - 1):                      # a random selection of the visible entries
            for j in range(n_c4):
                pick = torch.randperm((t + 1) // 4, generator=g)[:K]
                rec[t, j, :len(pick)] = pick
        recs.append(rec)
        eps.append(grpo.Episode(ids[:P], ids[P:], [-1.0] * R, float(i % 2), i // 2, "stop",
                                indexer_topk=grpo.entry_record(rec)))
    return grpo.pack(eps, grpo.episode_advantages(eps, 2)), recs


def _pp2_rank(rank, world):
    from nanoflash.parallel.dims import ParallelDims
    from nanoflash.rl.trainer import Trainer, scatter_shards
    cfg = _replay_cfg(2)
    mcfg = preset("tiny", **cfg.model)
    dims = ParallelDims(pp=2)
    actor = Trainer(cfg, mcfg, dims)
    actor.start_optimizer()
    batch = _replay_batch(mcfg)[0] if rank == 0 else None
    shard, _ = scatter_shards(batch, dims, {})
    old = actor.logprobs(shard)
    if shard is not None:
        shard.old_logprobs = old
    m = actor.train(shard)
    return {"stage": dims.pp_rank, "old": old, "loss": m.get("loss")}


def test_indexer_replay_at_pp2_with_recompute_equals_one_process():
    """PP2 (tiny: C4 layer 1 on stage 0, layer 3 on stage 1) with recompute: the record reaches both stages'
    C4 layers by the global layer order, so the old log-probs and the loss equal the single process's. Bug
    caught (planted): the C4 layers numbered per stage (stage 1's layer 3 read the record's first slice)."""
    from conftest import run_ranks
    from nanoflash.parallel.dims import ParallelDims
    from nanoflash.rl.trainer import Trainer, scatter_shards
    cfg = _replay_cfg(1)
    mcfg = preset("tiny", **cfg.model)
    actor = Trainer(cfg, mcfg, ParallelDims())
    actor.start_optimizer()
    shard, _ = scatter_shards(_replay_batch(mcfg)[0], ParallelDims(), {})
    shard.old_logprobs = old = actor.logprobs(shard)
    loss = actor.train(shard)["loss"]
    results = run_ranks(_pp2_rank, 2)
    first = next(r for r in results if r["stage"] == 0)
    assert (first["old"] - old).abs().max() <= 1e-5
    assert all(r["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6) for r in results if r["loss"] is not None)


def test_the_trainer_replays_the_record_in_every_forward():
    """`rollout.indexer_replay`: the packed record travels as a micro-batch field through the trainer's
    forward-only pass, its training forward and the recomputed forward (recompute on), and every C4 indexer
    call gets it; the old log-probs equal a plain forward with the record replayed (the naive reference) and
    differ from the trainer's own selection. Bug caught: the field left out of the micro-batches (replay
    silently off), or dropped by the recomputed forward."""
    from nanoflash.parallel.dims import ParallelDims
    from nanoflash.rl.trainer import Trainer, scatter_shards
    cfg = _replay_cfg(1)
    mcfg = preset("tiny", **cfg.model)
    batch, recs = _replay_batch(mcfg)
    actor = Trainer(cfg, mcfg, ParallelDims())
    actor.start_optimizer()
    calls = []
    for i in c4_layers(mcfg):
        ix = actor.model.get_submodule(f"layers.{i}.attn.indexer")

        def wrapped(*a, _f=ix.forward, **k):
            calls.append(k.get("kept", a[6] if len(a) > 6 else None) is not None)
            return _f(*a, **k)
        ix.forward = wrapped
    shard, _ = scatter_shards(batch, ParallelDims(), {})
    old = actor.logprobs(shard)
    fwd_only, calls[:] = list(calls), []
    m = actor.model
    with torch.no_grad():
        for b, rec in enumerate(recs):
            L = len(rec)
            ids, tgt = batch.input_ids[b:b + 1, :L], batch.targets[b:b + 1, :L]
            lp_of = lambda **kw: torch.log_softmax(m.logits(m.run_layers(m.embed_streams(ids), ids, **kw)).float()  # noqa: E731
                                                   / cfg.rollout.temperature, -1).gather(-1, tgt[..., None])[0, :, 0]
            want, own = lp_of(indexed=(rec + 1)[None]), lp_of()
            on = batch.mask[b, :L] > 0
            assert (old[b, :L][on] - want[on]).abs().max() <= 1e-5, b
            if L > 17:                                   # rows long enough for the top-k to select
                assert (want[on] - own[on]).abs().max() > 1e-3, b
    shard.old_logprobs = old
    calls[:] = []
    actor.train(shard)
    assert fwd_only and all(fwd_only) and all(calls)
    assert len(calls) == 2 * len(fwd_only)                # each micro-batch: the training and the recomputed forward


def test_the_live_checks_forwards_replay_the_record_too(gen):
    """With indexer replay the trainer's old log-probs replay the record, so the live checks' entropy and FP8
    floor forwards must too (else the floor measures a selection the gap no longer has): `masked_scores`' log-probs
    and entropy with `indexed` equal the plain forward with the record, row chunk by row chunk."""
    from instruments.live import masked_scores
    model = _model().eval()
    ids = torch.randint(0, model.cfg.vocab_size, (3, S), generator=gen)
    tgt = torch.roll(ids, -1, 1)
    on = torch.zeros(3, S, dtype=torch.bool)
    on[:, 20:] = True
    rec = own_selection(model, ids).flip(2) + 1          # the layers' selections exchanged: not the model's own
    with torch.no_grad():
        logp = torch.log_softmax(model.logits(model.run_layers(model.embed_streams(ids), ids, indexed=rec)), -1)
    want = logp.gather(-1, tgt[..., None])[..., 0][on]
    got, got_ent = masked_scores(model, ids, tgt, on, 1.0, tokens=2 * S, indexed=rec)   # chunks of two rows
    own, _ = masked_scores(model, ids, tgt, on, 1.0, tokens=2 * S)
    assert torch.allclose(got, want, atol=1e-5, rtol=0) and (got - own).abs().max() > 1e-3
    ent = -(logp.exp() * logp).sum(-1)[on]
    assert torch.allclose(got_ent, ent, atol=1e-4, rtol=0)


@pytest.mark.parametrize("score", ["exact", "batched"])
def test_the_embedded_server_reports_the_kept_sets_of_its_scoring_forward(gen, score):
    """`return_indexer_topk` on nanoflash's server: each sample's record is SGLang's format ([prompt + output - 1,
    C4 layers, index_topk] int32, -1 padded) holding the entries the model's own indexer keeps on that sample
    (`own_selection`, a forward of its own), scored alone or in one right-padded forward with a longer sample;
    R3 records travel beside it; the client decodes it and the collector's check accepts it. Bugs caught: the
    record of the other sample of the padded batch or of the padding, C4 layers in another order, a row
    shifted by one, the entries of the prompt alone."""
    import threading
    from nanoflash.server.engine import RolloutEngine, parse_sampling
    from nanoflash.sglang.client import decode_indexer_topk
    model = _model().eval()
    engine = RolloutEngine(_model(), weights="fp32", score=score)
    prompts = {"a": torch.randint(0, 256, (30,), generator=gen).tolist(),
               "b": torch.randint(0, 256, (37,), generator=gen).tolist()}
    out, threads = {}, []
    engine.pause("in_place")                                    # both join one step: one padded scoring forward
    for k, p in prompts.items():
        sp = parse_sampling({"n": 1, "max_new_tokens": 6, "stop_token_ids": [],
                             "sampling_seed": 5}, 256)
        threads.append(threading.Thread(target=lambda k=k, p=p, sp=sp: out.__setitem__(
            k, engine.generate(p, sp, rid=k, records=("routed_experts", "indexer_topk"))), daemon=True))
        threads[-1].start()
    while len(engine.waiting) < 2:
        threading.Event().wait(0.002)
    engine.unpause()
    for t in threads:
        t.join(timeout=60)
    K, n_c4 = model.cfg.index_topk, len(c4_layers(model.cfg))
    for k, p in prompts.items():
        meta = out[k][0]["meta_info"]
        full = torch.tensor(p + out[k][0]["output_ids"])
        got = decode_indexer_topk(meta, n_c4, K)                                          # [L-1,n_c4,K]
        want = own_selection(model, full[None, :-1])[0]
        assert got.shape == (len(full) - 1, n_c4, K) and "routed_experts" in meta, k
        assert torch.equal(got, want.long()), k
        assert (got[:15] < 0).sum() > 0 and (got[-1] >= 0).all(), k   # early queries padded, the last selects
        check_replay_record(got, K)


def test_a_model_without_c4_layers_reports_no_record_as_sglang():
    """SGLang 0.5.16 disables the capture when the model has no indexer layer (`create_indexer_capturer`:
    "No indexer layers found") and answers without a record; the embedded server does the same and says so in
    /server_info, so indexer replay's preflight refuses it by name. Bug caught: a crash stacking no layers."""
    from nanoflash.server.engine import RolloutEngine, parse_sampling
    from nanoflash.server.http import serve
    from nanoflash.sglang.client import SGLangClient
    from nanoflash.sglang.preflight import ServerMismatch, check_indexer_topk
    cfg = preset("tiny", compress_ratios=(0, 128, 0, 128, 0))
    assert c4_layers(cfg) == []
    engine = RolloutEngine(Transformer(cfg).init_weights(0), weights="fp32")
    sp = parse_sampling({"n": 1, "max_new_tokens": 2, "stop_token_ids": [], "sampling_seed": 1}, 256)
    meta = engine.generate(list(range(1, 21)), sp, records=("routed_experts", "indexer_topk"))[0]["meta_info"]
    assert "routed_experts" in meta and "indexer_topk" not in meta
    httpd, url = serve(engine)
    try:
        with pytest.raises(ServerMismatch, match="enable_return_indexer_topk=False"):
            check_indexer_topk(SGLangClient(url), cfg)
    finally:
        httpd.shutdown()


def test_rl_notes_quotes_the_records_size_of_the_flash_config():
    """docs/rl_notes.md §2.5 sizes the indexer record for V4-Flash; the numbers are the flash preset's (C4 layers,
    index_topk, MoE layers and top-k) at SGLang's int32 and base64's 4/3, and the recipe keeps replay off.
    Bug caught: a number left stale after the config or the format changed."""
    import os
    from nanoflash.cli import parse_args
    cfg = preset("flash")
    n_c4, K = len(c4_layers(cfg)), cfg.index_topk
    text = " ".join(open(os.path.join(os.path.dirname(__file__), "..", "docs", "rl_notes.md")).read().split())
    per_token = n_c4 * K * 4
    want = (f"{n_c4} C4 layers x {K} entries x 4 B = {per_token:,} B a token ({per_token * 4 // 3:,} B as base64 "
            f"JSON), against R3's {cfg.n_layers} layers x {cfg.n_activated_experts} experts x 4 B = "
            f"{cfg.n_layers * cfg.n_activated_experts * 4:,} B; a 4K-token sample carries "
            f"~{round(4096 * per_token * 4 / 3 / 1e6)} MB of JSON")
    assert want in text, want
    assert not parse_args(["--recipe", "flash"]).rollout.indexer_replay


def test_kept_record_reads_the_mask_and_the_kernels_index_list_alike(gen):
    """The embedded engine's record from either form an indexer returns -- the reference's keep mask [B,S,C] and
    the kernels' index list [B,S,min(K,C)] (-1 padded, any order; on a GPU) -- is the same [B,S,C4 layers,K]
    (highest entry first, -1 padded to index_topk), and all -1 for a layer with no entries yet. Bug caught: the
    GPU's index list taken as a mask, or not padded to index_topk."""
    from nanoflash.server.engine import kept_record
    cfg = preset("tiny")
    K, (a, b) = cfg.index_topk, c4_layers(cfg)
    mask = torch.rand(2, 9, 7, generator=gen) < 0.4
    mask &= mask.cumsum(-1) <= K                                                 # at most K kept a query
    lists = torch.where(mask, torch.arange(7), -1).to(torch.int32).sort(-1, descending=True).values[..., :K]
    lists = lists.gather(-1, torch.rand(2, 9, K, generator=gen).argsort(-1))      # K columns, any order
    want = kept_record({a: mask, b: torch.zeros(2, 9, 0, dtype=torch.bool)}, cfg)
    got = kept_record({a: lists, b: torch.zeros(2, 9, 0, dtype=torch.int32)}, cfg)
    assert want.shape == (2, 9, 2, K) and (want[:, :, 1] == -1).all()
    assert torch.equal(got, want) and (want[:, :, 0] >= 0).sum() == mask.sum()
