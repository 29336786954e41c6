"""Per-stage weight push (`rollout/stage_push.py`) on gloo: a tiny model cut at PP2 x EP2 by the engine's own
`build_stage` + `apply_expert_parallel`, each stage pushing from its own ranks into two embedded servers (one
reporting tp_size 2), against a single-process push of the same model through the older `push_weights` path.

Run: `pytest tests/test_weight_sync_stage.py -q`.
"""
from __future__ import annotations

import tempfile
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nanoflash.config import RolloutConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel.dims import ParallelDims
from nanoflash.parallel.expert import apply_expert_parallel
from nanoflash.parallel.pipeline import build_stage
from nanoflash.sglang.client import RequestRejected, SGLangClient
from nanoflash.server.engine import RolloutEngine
from nanoflash.server.http import serve
from nanoflash.quant import quant_scratch_bytes
from nanoflash.sglang.layout import sglang_fp8
from nanoflash.parallel.planner import live_budget
from nanoflash.sglang.push import StagePusher
from nanoflash.sglang.transports import Broadcaster, PushFailed, iter_sglang_buckets, push_weights
from conftest import free_port, run_ranks

BUCKET = 1 << 15            # 32 KiB: the tiny model's stream becomes ~20-50 buckets, and experts sub-buckets
COMBOS = [(w, t) for w in ("fp8", "fp32") for t in ("distributed", "tensor", "disk")]
SERVER_TP = (1, 2)          # the second server joins two ranks per group: world = 1 + 1 + 2


def _servers(weights: str):
    """Two embedded servers on a model the push must overwrite (seed 1; the trainer is seed 0)."""
    return [serve(RolloutEngine(Transformer(preset("tiny")).init_weights(1), weights=weights), tp_size=tp,
                  disk_root=tempfile.gettempdir())  # the tests' disk pushes are below it
            for tp in SERVER_TP]


def _landed(servers) -> list:
    """What each server holds: its loader layout's checksums and the weights its model runs with."""
    return [(h.rollout.engine.store.checksums(), h.rollout.engine.derived_checksum(), h.rollout.engine.weight_version)
            for h, _ in servers]


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created under the mode and still referenced (this thread only: dispatch
    modes are thread-local, so the in-process servers' threads are not counted). Storages in `skip` (the
    rank's own shard) are not counted either."""

    def __init__(self, skip=()):
        super().__init__()
        self.skip, self.refs, self.size, self.live, self.peak = set(skip), {}, {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                self._track(t)
        return out

    def _track(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.skip:
            return
        if key not in self.refs:
            self.refs[key], self.size[key] = 0, t.untyped_storage().nbytes()
            self.live += self.size[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key):
        self.refs[key] -= 1
        if not self.refs[key]:
            self.live -= self.size.pop(key)
            del self.refs[key]


def _sharded_model(dims):
    model = Transformer(preset("tiny")).init_weights(0)
    return apply_expert_parallel(build_stage(model, dims), dims)


def _push_ranks(rank, world, base_port, disk_root):
    """Every combination of precision and transport in one set of PP2 x EP2 processes."""
    torch.manual_seed(0)
    dims = ParallelDims(pp=2, ep=2)
    model, out = _sharded_model(dims), {}
    shard = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    shard_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # stacked experts: one
                       for t in model.state_dict().values()}.values())               # storage, many views
    for i, (weights, transport) in enumerate(COMBOS):
        servers = _servers(weights) if rank == 0 else []
        client = SGLangClient([u for _, u in servers]) if rank == 0 else None
        rc = RolloutConfig(weights=weights, transport=transport, bucket_bytes=BUCKET,
                           sync_addr=f"127.0.0.1:{base_port + 10 * i}")
        pusher = StagePusher(dims, client, rc, model.cfg, disk_dir=f"{disk_root}/{weights}-{transport}")
        with LiveBytes(skip=shard) as mem:
            info = pusher.push(lambda: model.state_dict().items(), version=3)
        out[(weights, transport)] = {"landed": _landed(servers), "info": info, "peak": mem.peak,
                                     "world": pusher.broadcaster.world if pusher.broadcaster else None,
                                     "shard_bytes": shard_bytes}
        for h, _ in servers:
            h.shutdown()
    return out


def _single_process(weights: str, transport: str, port: int, disk: str):
    """The reference: the whole model in one process, pushed by `push_weights`."""
    servers = _servers(weights)
    client = SGLangClient([u for _, u in servers])
    model = Transformer(preset("tiny")).init_weights(0)
    bc = Broadcaster(client, "127.0.0.1", port) if transport == "distributed" else None
    push_weights(client, iter_sglang_buckets(model, fp8=weights == "fp8", bucket_bytes=BUCKET), version=3,
                 transport=transport, broadcaster=bc, disk_dir=disk)
    landed = _landed(servers)
    for h, _ in servers:
        h.shutdown()
    return landed


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    ports = free_port(10 * len(COMBOS))  # combo i: its stages' groups at base + 10 i + stage (+ pp per reconnect)
    per_rank = run_ranks(_push_ranks, 4, ports, str(tmp_path_factory.mktemp("disk")), timeout=300)
    return per_rank


@pytest.mark.parametrize("weights,transport", COMBOS)
def test_pp2_ep2_push_lands_bit_identical_to_single_process(sharded, weights, transport, tmp_path):
    got = sharded[0][(weights, transport)]
    want = _single_process(weights, transport, free_port(), str(tmp_path / "ref"))
    for (sums, derived, version), (rsums, rderived, rversion) in zip(got["landed"], want):
        assert sums == rsums                    # the pushed layout, tensor by tensor (sha256 of the bytes)
        assert derived == rderived              # the weights the server's model runs with
        assert version.split("-")[0] == rversion == "3"   # the pusher's "{version}-{launch}" (StagePusher.tag)
    assert set(got["info"]["verified"].values()) == {"checksums"}
    assert sorted(got["info"]["bytes_per_source"]) == [0, 1]   # each stage sent from its own source rank
    if transport == "distributed":
        assert {r[(weights, transport)]["world"] for r in (sharded[0], sharded[2])} == {1 + sum(SERVER_TP)}


def _budget(weights: str) -> int:
    """`live_budget` for the tiny model: its largest bucket (a unit above BUCKET travels alone) and the CPU
    quantizer's scratch for its largest FP8 weight."""
    model = Transformer(preset("tiny")).init_weights(0)
    largest = max(sum(t.numel() * t.element_size() for _, t in b)
                  for b in iter_sglang_buckets(model, fp8=weights == "fp8", bucket_bytes=BUCKET))
    fp8 = [t.shape for n, t in model.state_dict().items() if weights == "fp8" and t.ndim == 2
           and not n.startswith("mtp.") and sglang_fp8(n, model.cfg)]
    return live_budget(largest, 2, max((quant_scratch_bytes(s) for s in fp8), default=0))


def test_no_rank_holds_more_than_its_shard_plus_the_bucket_budget(sharded):
    """Measured per rank (LiveBytes): new tensor bytes alive at once during the push stay within `live_budget`
    (LIVE_BUCKETS + 1/ep buckets and the quantizer's bounded scratch), far below a shard."""
    for weights in ("fp8", "fp32"):
        budget = _budget(weights)
        for rank, res in enumerate(sharded):
            for (w, t), r in res.items():
                if w == weights:
                    assert 0 < r["peak"] <= budget, f"rank {rank} {w}/{t}: peak {r['peak']} B > budget {budget} B"
                    assert rank % 2 or r["peak"] >= BUCKET, f"source rank {rank}: the tracker missed its buckets"
                    assert r["peak"] < r["shard_bytes"] / 2, f"rank {rank} {w}/{t}: held half a shard's bytes"


def test_failed_push_keeps_servers_paused_then_retries_or_names_the_server(tmp_path):
    servers = _servers("fp8")
    client = SGLangClient([u for _, u in servers], retry_s=0.0)
    model = Transformer(preset("tiny")).init_weights(0)
    rc = RolloutConfig(weights="fp8", transport="tensor", bucket_bytes=BUCKET, sync_addr="127.0.0.1:1")
    pusher = StagePusher(ParallelDims(), client, rc, model.cfg, max_retries=1)
    real_post, calls = client.post, {"n": 0, "always": False}

    def flaky(url, path, body=None, **kw):
        if path == "/update_weights_from_tensor" and url == client.urls[1]:
            calls["n"] += 1
            if calls["n"] == 3 or calls["always"]:   # one bucket refused once, mid-push (then: every one)
                assert all(h.rollout.engine.paused for h, _ in servers)
                raise RequestRejected(url + path, 500, "injected failure")
        return real_post(url, path, body, **kw)
    client.post = flaky
    info = pusher.push(lambda: model.state_dict().items(), version=5)
    assert info["version"] == 5 and set(info["verified"].values()) == {"checksums"}
    assert [h.rollout.engine.weight_version for h, _ in servers] == [pusher.tag(5)] * 2
    assert not any(h.rollout.engine.paused for h, _ in servers)
    calls["always"] = True
    with pytest.raises(PushFailed, match=client.urls[1]):
        pusher.push(lambda: model.state_dict().items(), version=6)
    assert all(h.rollout.engine.paused for h, _ in servers)                       # left paused
    assert [h.rollout.engine.weight_version for h, _ in servers] == [pusher.tag(5)] * 2    # still the last good version
    for h, _ in servers:
        h.shutdown()



def _failing_source_ranks(rank, world, port):
    """EP2: the source's server refuses a bucket mid-stage; the source keeps draining its EP rank's gathers, so
    both ranks stop with the same error instead of one waiting forever in a collective."""
    dims = ParallelDims(pp=1, ep=2)
    model = _sharded_model(dims)
    servers = _servers("fp8") if rank == 0 else []
    client = SGLangClient([u for _, u in servers], retry_s=0.0) if rank == 0 else None
    if client is not None:
        real_post, n = client.post, [0]

        def refuse_third(url, path, body=None, **kw):
            n[0] += path == "/update_weights_from_tensor"
            if n[0] == 3 and path == "/update_weights_from_tensor":
                raise RequestRejected(url + path, 500, "injected failure")
            return real_post(url, path, body, **kw)
        client.post = refuse_third
    rc = RolloutConfig(weights="fp8", transport="tensor", bucket_bytes=BUCKET, sync_addr=f"127.0.0.1:{port}")
    pusher = StagePusher(dims, client, rc, model.cfg, max_retries=0)
    try:
        pusher.push(list(model.state_dict().items()), version=2)
        return "pushed"
    except PushFailed as e:
        return str(e)
    finally:
        for h, _ in servers:
            h.shutdown()


def test_failing_source_stops_every_rank_naming_the_server():
    msgs = run_ranks(_failing_source_ranks, 2, free_port(), timeout=120)
    assert all("injected failure" in m and "failed after 1 attempt" in m for m in msgs), msgs


@pytest.mark.parametrize("fault,match", [("lost", "missing"), ("doubled", "sent twice")])
def test_manifest_names_a_lost_or_doubled_bucket(fault, match):
    """The coordinator checks every source's manifest against the model's inventory before any checksum: a bucket
    that never reached the manifest, or reached it twice, is named."""
    servers = _servers("fp8")
    client = SGLangClient([u for _, u in servers])
    model = Transformer(preset("tiny")).init_weights(0)
    rc = RolloutConfig(weights="fp8", transport="tensor", bucket_bytes=BUCKET, sync_addr="127.0.0.1:1")
    pusher = StagePusher(ParallelDims(), client, rc, model.cfg, max_retries=0)
    record, seen = pusher._record, []

    def faulty(fb, ledger):
        seen.append(fb)
        if fault == "lost" and len(seen) == 2:
            return                      # bucket 2 is sent but never recorded
        record(fb, ledger)
        if fault == "doubled" and len(seen) == 2:
            record(fb, ledger)
    pusher._record = faulty
    with pytest.raises(PushFailed, match=match) as e:
        pusher.push(list(model.state_dict().items()), version=1)
    assert any(slot.name in str(e.value) for slot in seen[1].slots), e.value   # named by the bucket's tensors
    for h, _ in servers:
        h.shutdown()
