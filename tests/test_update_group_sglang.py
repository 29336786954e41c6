"""The weight-update group, met from SGLang's side as SGLang 0.5.16 builds it (issue 36, item 1).

The bug these catch: a group built by a construction of our own that SGLang's does not meet. nanoflash's sender
used to build `ProcessGroupGloo(PrefixStore(group_name, TCPStore))` and waited for store key
`nanoflash-pp0/0/1`, while SGLang's `init_custom_process_group` goes through torch's `_new_process_group_helper`,
which nests "<group_name>/" and "cpu/" (gloo) or "cuda/" (NCCL) under the group_name prefix: its ranks wait for
`nanoflash-pp0/nanoflash-pp0//cpu//0/0`, so both sides timed out; the embedded server joined the trainer's way, so
every CPU test passed.

The SGLang side here is a copy written from SGLang's source (never nanoflash's join code):

- `init_custom_process_group`: sglang 0.5.16 wheel, python/sglang/srt/utils/common.py L2424-2492;
- its caller `WeightUpdater.init_weights_update_group` (srt/model_executor/model_runner_components/
  weight_updater.py L48-92): rank = rank_offset + tp_rank, init_method = "tcp://host:port", no timeout;
- the receive, `WeightUpdater.update_weights_from_distributed` (same file L183-240: one async broadcast from src 0
  per (name, dtype, shape) of the HTTP body) and `_update_bucketed_weights_from_distributed` (L242-270:
  load_format="flattened_bucket", one uint8 broadcast laid out by `FlattenedTensorBucket`,
  srt/weight_sync/tensor_bucket.py: each tensor `.flatten().view(torch.uint8)`, concatenated in body order).

Its one departure is the join timeout (SGLang: torch's default_pg_timeout, 30 min), cut to JOIN_TIMEOUT_S so that
a mismatch fails in seconds instead of hanging. Each SGLang TP rank is a spawned process with its own default
group over the TP ranks, as SGLang's schedulers have.

Planted (in a copy of the tree): `join_group` back to the old `ProcessGroupGloo(PrefixStore(group_name, store))`
-> both tests fail at the join timeout (see the commit message for the record).
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import queue

import pytest
import torch
import torch.distributed as dist

from conftest import free_port
from nanoflash.sglang.client import RequestRejected
from nanoflash.sglang.buckets import FlatBucket, Slot
from nanoflash.sglang.transports import Broadcaster, join_receivers, leave_group, receive_bucket

# A join both sides reach within this: spawning a TP rank (a fresh interpreter importing torch) takes 2-6 s on the
# 2-core CI box, 3 of them at once up to ~12 s; a construction mismatch is a timeout, so this bounds a failure.
JOIN_TIMEOUT_S = 40.0
# How long the trainer side waits for a receiver's answer after its broadcast (the bytes are tiny).
ANSWER_TIMEOUT_S = 30.0


# ------------------------------------------------------------------------ SGLang 0.5.16, copied from its source
def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                              group_name=None, pg_options=None, device_id=None):
    """sglang 0.5.16, python/sglang/srt/utils/common.py, `init_custom_process_group` (L2424-2492), as written
    there (`torch_release` is SGLang's torch version tuple)."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    default_pg_timeout, rendezvous)
    assert (store is None) or (init_method is None), "Cannot specify both init_method and store."
    if store is not None:
        assert world_size > 0, "world_size must be positive if using store"
        assert rank >= 0, "rank must be non-negative if using store"
    elif init_method is None:
        init_method = "env://"
    backend = Backend(backend) if backend else Backend("undefined")
    if timeout is None:
        timeout = default_pg_timeout
    if store is None:
        rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
        store, rank, world_size = next(rendezvous_iterator)
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    torch_release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    pg_options_param_name = "backend_options" if torch_release >= (2, 6) else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                      **{pg_options_param_name: pg_options}, timeout=timeout, device_id=device_id)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _sglang_receive(pg, body: dict, device="cpu") -> list:
    """weight_updater.py `update_weights_from_distributed` / `_update_bucketed_weights_from_distributed`, minus the
    model's load_weights: -> [(name, tensor)] as the model would be handed them."""
    named = [(n, torch.empty(s, dtype=getattr(torch, d), device=device))
             for n, d, s in zip(body["names"], body["dtypes"], body["shapes"])]
    if body.get("load_format") == "flattened_bucket":
        flat = torch.cat([t.flatten().view(torch.uint8) for _, t in named], dim=0)   # FlattenedTensorBucket
        dist.broadcast(flat, src=0, group=pg)
        out, pos = [], 0
        for n, t in named:
            k = t.numel() * t.element_size()
            out.append((n, flat[pos:pos + k].view(t.dtype).reshape(t.shape)))
            pos += k
        return out
    handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in named]
    for h in handles:
        h.wait()
    return named


def _sglang_tp_rank(tp_rank, tp, default_port, req: dict, inbox, outbox):
    """One SGLang scheduler: its default group (the TP ranks), then the update group as the route builds it, then
    every `/update_weights_from_distributed` body from `inbox` until a destroy."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{default_port}", rank=tp_rank, world_size=tp,
                                timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        pg = init_custom_process_group(backend=req["backend"],
                                       init_method=f"tcp://{req['master_address']}:{req['master_port']}",
                                       world_size=req["world_size"], rank=req["rank_offset"] + tp_rank,
                                       group_name=req["group_name"],
                                       timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        outbox.put((tp_rank, "joined", pg.rank()))
        while True:
            body = inbox.get(timeout=JOIN_TIMEOUT_S)
            if body.get("destroy"):
                dist.destroy_process_group(pg)
                outbox.put((tp_rank, "destroyed", None))
                return
            got = _sglang_receive(pg, body)
            outbox.put((tp_rank, "bucket", [(n, t.clone()) for n, t in got]))
    except BaseException as e:
        outbox.put((tp_rank, "error", f"{type(e).__name__}: {e}"))


class SGLangStandIn:
    """What `Broadcaster` talks to: one 'server' whose TP ranks are spawned processes running SGLang's code."""

    def __init__(self, tp: int):
        self.tp, self.urls, self.ctx = tp, ["http://sglang-0.5.16"], mp.get_context("spawn")
        self.inboxes = [self.ctx.Queue() for _ in range(tp)]
        self.outbox, self.procs, self.received = self.ctx.Queue(), [], []

    def server_ranks(self, url):
        return self.tp

    def supports_flattened(self, url):
        return True

    def init_weights_update_group(self, url, master_address, master_port, rank_offset, world_size, group_name,
                                  backend):
        req = dict(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                   world_size=world_size, group_name=group_name, backend=backend)
        port = free_port()
        self.procs = [self.ctx.Process(target=_sglang_tp_rank, args=(r, self.tp, port, req, self.inboxes[r],
                                                                      self.outbox), daemon=True)
                      for r in range(self.tp)]
        for p in self.procs:
            p.start()
        got = self._answers("joined", JOIN_TIMEOUT_S + 10)
        assert sorted(got.values()) == list(range(rank_offset, rank_offset + self.tp))

    def post(self, url, path, body, **kw):
        if path == "/destroy_weights_update_group":
            if not any(p.is_alive() for p in self.procs):   # SGLang 0.5.16: 400, "does not exist"
                raise RequestRejected(url + path, 400, "The group to be destroyed does not exist.")
            body = {"destroy": True}
        elif path != "/update_weights_from_distributed":
            raise AssertionError(f"unexpected POST {path}")
        for box in self.inboxes:
            box.put(body)
        got = self._answers("destroyed" if body.get("destroy") else "bucket", ANSWER_TIMEOUT_S)
        if not body.get("destroy"):
            self.received.append((body.get("load_format"), got))
        return {"success": True}

    def _answers(self, what: str, timeout: float) -> dict:
        out = {}
        while len(out) < self.tp:
            try:
                r, kind, val = self.outbox.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"SGLang stand-in: {self.tp - len(out)} rank(s) gave no {what!r} "
                                   f"in {timeout:.0f}s") from None
            if kind == "error":
                raise RuntimeError(f"SGLang TP rank {r}: {val}")
            assert kind == what, (kind, what)
            out[r] = val
        return out

    def stop(self):
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()


# SGLang's per-tensor receive allocates each tensor in its own dtype, and gloo refuses float8 ("Invalid scalar
# type", torch 2.13, seen here): over gloo, FP8 weights reach SGLang only in a flattened bucket (uint8), which
# Broadcaster sends whenever the server takes it (SGLang >= 0.5.16). The per-tensor buckets below hold no FP8.
GLOO_NO_FP8 = True


def _tensors(gen) -> list:
    """A bucket of the dtypes a push carries: FP8 weights, fp32 scales, bf16 norms."""
    w = (torch.randn(8, 16, generator=gen) * 100).to(torch.float8_e4m3fn)
    return [("model.layers.0.mlp.w.weight", w),
            ("model.layers.0.mlp.w.weight_scale_inv", torch.rand(1, 2, generator=gen)),
            ("model.norm.weight", torch.randn(5, 3, generator=gen).to(torch.bfloat16))]


def _flat(named) -> FlatBucket:
    """nanoflash's flat bucket of `named` (laid out largest element first, as stream.FlatBucket.layout does)."""
    named = sorted(named, key=lambda nt: -nt[1].element_size())
    slots, pos = [], 0
    for n, t in named:
        slots.append(Slot(n, t.dtype, list(t.shape), pos, pos + t.numel() * t.element_size()))
        pos = slots[-1].end
    return FlatBucket(torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named]), slots)


def _same_bytes(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


# suite time: 1 and 3 receivers in the default run, 2 with -m slow (the same code path)
@pytest.mark.parametrize("group_name,tp", [("nanoflash-pp0", 1), pytest.param("nanoflash-pp1", 2, marks=pytest.mark.slow),
                                           ("miles_sync.v2", 3)])
def test_trainer_group_meets_sglang_0_5_16_receivers(group_name, tp, gen):
    """nanoflash's sender (Broadcaster -> join_group, rank 0) and SGLang's receivers (ranks 1..tp) form one group;
    a per-tensor bucket and a flattened bucket arrive byte for byte on every TP rank, under the names, dtypes and
    shapes of the HTTP body; then the group is destroyed on both sides, and the same name joins again (torch, on
    either side, refuses a name it still holds)."""
    sg = SGLangStandIn(tp)
    try:
        for attempt in range(2 if tp == 1 else 1):      # a second join of the name: once is enough (spawn cost)
            bc = Broadcaster(sg, "127.0.0.1", free_port(), backend="gloo", group_name=group_name,
                             timeout_s=JOIN_TIMEOUT_S)
            assert bc.world == 1 + tp and bc.flat_ok
            named = _tensors(gen)
            sg.received.clear()
            bc.send(named[1:], weight_version=str(attempt))       # per tensor: no FP8 over gloo (GLOO_NO_FP8)
            bc.send(_flat(named), weight_version=str(attempt))
            bc.close()
            sg.stop()
            assert [fmt for fmt, _ in sg.received] == [None, "flattened_bucket"]
            for (fmt, per_rank), sent in zip(sg.received, (named[1:], named)):
                want = dict(sent)
                assert sorted(per_rank) == list(range(tp))
                for r, got in per_rank.items():
                    assert sorted(n for n, _ in got) == sorted(want), (fmt, r)
                    bad = [n for n, t in got if not _same_bytes(t, want[n])]
                    assert not bad, f"{fmt or 'per-tensor'} bucket, TP rank {r}: {bad} arrived changed"
    finally:
        sg.stop()


def _sglang_style_sender(rank, world, port, group_name, bodies, tensors):
    """The trainer side as SGLang's own tests and Miles build it: `init_custom_process_group` at rank 0, then one
    broadcast per body (flat: the FlattenedTensorBucket bytes)."""
    torch.set_num_threads(1)
    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=0,
                                   group_name=group_name, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    for body, named in zip(bodies, tensors):
        if body.get("load_format") == "flattened_bucket":
            dist.broadcast(torch.cat([t.flatten().view(torch.uint8) for _, t in named]), src=0, group=pg)
        else:
            for _, t in named:
                dist.broadcast(t, src=0, group=pg)
    dist.destroy_process_group(pg)


@pytest.mark.parametrize("group_name,tp", [pytest.param("nanoflash-pp0", 1, marks=pytest.mark.slow), ("nanoflash-pp3", 3)])
def test_embedded_server_ranks_meet_an_sglang_style_sender(group_name, tp, gen):
    """The embedded server's side (`join_receivers`, `receive_bucket`: what /init_weights_update_group and
    /update_weights_from_distributed run) against a rank 0 built by SGLang's function, not by the trainer's
    join_group: the stand-in cannot share a construction bug with the trainer unnoticed."""
    named = _tensors(gen)
    buckets = [named[1:], named]         # per tensor (no FP8 over gloo: GLOO_NO_FP8), then one flattened bucket
    bodies = [{"names": [n for n, _ in b], "dtypes": [str(t.dtype)[6:] for _, t in b],
               "shapes": [list(t.shape) for _, t in b], "load_format": fmt}
              for b, fmt in zip(buckets, (None, "flattened_bucket"))]
    port, ctx = free_port(), mp.get_context("spawn")
    sender = ctx.Process(target=_sglang_style_sender, args=(0, 1 + tp, port, group_name, bodies, buckets),
                         daemon=True)
    sender.start()
    pgs = []
    try:
        pgs = join_receivers("127.0.0.1", port, range(1, 1 + tp), 1 + tp, group_name, "gloo", JOIN_TIMEOUT_S)
        for body in bodies:
            specs = [(n, getattr(torch, d), s) for n, d, s in zip(body["names"], body["dtypes"], body["shapes"])]
            got = receive_bucket(pgs, "gloo", specs, body["load_format"] == "flattened_bucket")
            bad = [n for n, t in got if not _same_bytes(t, dict(named)[n])]
            assert not bad, f"{body['load_format'] or 'per-tensor'}: {bad} arrived changed"
        sender.join(JOIN_TIMEOUT_S)
        assert sender.exitcode == 0
    finally:
        for pg in pgs:
            leave_group(pg)
        if sender.is_alive():
            sender.kill()
