"""Per-stage weight push: every pipeline stage's tensors leave from its own ranks; no rank holds the model.

Who sends (the PP x DP x EP grid of `ParallelDims`). DP replicas hold the same weights, so only dp_rank 0
takes part. For stage s the *source* is the rank (pp=s, dp=0, ep=0). It owns one weight-update group
`nanoflash-pp{s}` (rank 0 = the source, then every receiving rank of every server, as many per server as the
server reports: `client.server_ranks`) and sends, in buckets of `bucket_bytes`:

    1. the stage's dense tensors (replicated over EP: the source's own copy; `embed` on the first stage,
       `head`/`norm`/`hc_head_*` on the last; MTP never);
    2. the stage's routed experts: each EP rank quantizes its own experts into sub-buckets of
       bucket_bytes / ep (the same boundaries on every EP rank: their experts have the same shapes, in the
       same order), the source gathers them over the EP group (`dist.gather` into one buffer, NVLink inside
       a node) and sends that buffer as one bucket, names moved to the global expert ids.

Double-buffered: bucket k+1 is built (quantized on the GPU, gathered) while bucket k is on the wire; stages
go in turn (a barrier of the side group is the lock). Why one gathering source per stage rather than every EP
rank a source of its own: an SGLang scheduler runs one `update_weights_from_distributed` at a time
(`managers/scheduler_components/weight_updater.py`), so EP sources of one stage could only take turns on the
receivers: the same bytes over the same kind of link, with EP times as many NCCL communicators held open
on every rollout GPU; the gather itself runs over NVLink, several times the inter-node link's bandwidth
(docs/benchmarks.md), and hides behind the wire.

Protocol (collective: every trainer rank calls `push`; global rank 0 holds the HTTP client of the RL loop):

    rank 0: pause -> flush -> [begin]      every stage s in turn: its source and EP ranks send
    rank 0: ledgers of every source -> [end] -> verify -> update_weight_version -> continue

Buckets carry no weight_version: the servers report the last good version until a push is verified. A push
that fails (an HTTP error, a broken group, a verification mismatch) leaves the servers paused; it is retried
from scratch on re-created groups `max_retries` times, then raises `PushFailed` naming the server on every rank
(the loop's restart policy, `rl/restarts.py`, waits for the servers and pushes again, or stops).

Transports: "distributed" as above; "tensor" (one host: colocated) posts each bucket's flat GPU buffer as
SGLang's CUDA-IPC `FlattenedTensorBucket` (the embedded server: safetensors); "disk" writes one fresh
directory per source and push (`{disk_dir}/v{version}/pp{s}`; only the last verified one is kept) and has
every server load it; "local" (one
process, embedded servers in it: the `gpu` recipe) posts a handle to the bucket's GPU tensors
(`transports.send_local_payload`).

Verification (rank 0), from each source's ledger: every expected SGLang name sent exactly once (a missing or
doubled bucket is named); embedded servers: their checksums equal the loader layout each source derived from
its own buckets; real SGLang (TP 1): SGLang's own hash (`layout.sglang_partials`), reproduced for every FP8
tensor including the fused experts; a raw tensor whose hash differs (SGLang stores another dtype) and every
tensor of a TP > 1 server is checked by change sets: it changed on the server iff what we sent changed.

Memory: a rank holds its shard plus at most `LIVE_BUCKETS` buckets (k on the wire, k+1 being built, the
verification copy of one) and the quantizer's bounded scratch; `tests/test_weight_sync_stage.py` measures it.

Tests: `pytest tests/test_weight_sync_stage.py -q`.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from nanoflash.names import fill_pattern, name_pattern
from nanoflash.parallel.expert import expert_range, is_expert_param
from nanoflash.sglang.client import SGLangClient
from nanoflash.sglang.layout import LoaderState, compare_checksums, sglang_checksums, sglang_partials
from nanoflash.sglang.transports import (SENDERS, Broadcaster, FlatBucket, PushFailed, end_stale_session,
                                           expected_names, stream_buckets, verify_real_server, write_disk_bucket)

LAUNCH_BYTES = 4  # the launch nonce of a pushed weight version: 8 hex digits, a 1 in 4e9 collision
GROUP = "nanoflash-pp{stage}"   # one weight-update group per pipeline stage (Miles: "miles-pp_{pp_rank}")


@dataclass
class Ledger:
    """What one rank sent in one push: per bucket its names; the layouts derived from them for verification."""
    stage: int
    names: list = field(default_factory=list)      # SGLang names in send order
    buckets: int = 0
    bytes: int = 0
    loader: dict = field(default_factory=dict)     # embedded servers: {layout name: sha256}
    sglang: dict = field(default_factory=dict)     # real servers: layout.sglang_partials of every bucket


def layout_digest(checksums: dict) -> str | None:
    """One sha256 over a loader layout's {name: sha256} (what the embedded servers hold), None if empty."""
    return hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(checksums.items())).encode()).hexdigest() \
        if checksums else None


def route_address(url: str) -> str:
    """This host's address on the route to `url`'s host: a UDP socket connected there (no packet is sent) and
    its local end. Not the host name's address, which a default Debian /etc/hosts maps to 127.0.1.1."""
    parts = urlsplit(url)
    with socket.socket(socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((parts.hostname, parts.port or 80))
        return s.getsockname()[0]


def source_host(sync_host: str, server_urls=()) -> str:
    """The address the servers reach this source at: loopback stays loopback (one host); else
    $NANOFLASH_SYNC_HOST; else this host's address on the route to the first server (each stage's source sits
    on its own node, so the address is its own, whatever rollout.sync_addr names)."""
    if sync_host in ("127.0.0.1", "localhost"):
        return sync_host
    if os.environ.get("NANOFLASH_SYNC_HOST"):
        return os.environ["NANOFLASH_SYNC_HOST"]
    if not server_urls:
        raise ValueError("rollout.sync_addr is not loopback but no server is known to route to; set "
                         "NANOFLASH_SYNC_HOST to this host's address on the servers' network")
    return route_address(server_urls[0])


def shift_expert(name: str, delta: int) -> str:
    """`model.layers.3.mlp.experts.5.gate_proj.weight`, +4 -> `...experts.9...` (another EP rank's expert)."""
    pat, nums = name_pattern(name)
    return fill_pattern(pat, [nums[0], str(int(nums[1]) + delta)]) if ".experts.#." in pat else name


class StagePusher:
    """Pushes a PP x EP sharded trainer's weights, one source per stage. Build it on every rank (collective).

    `client`: the RL loop's `SGLangClient` on global rank 0 (None elsewhere: the server list is broadcast);
    `rc`: the `RolloutConfig` (weights, transport, bucket_bytes, sync_addr, verify); `cfg`: the model config."""

    def __init__(self, dims, client, rc, cfg, *, disk_dir: str = "", timeout_s: float = 120.0, max_retries: int = 1):
        self.dims, self.rc, self.cfg, self.disk_dir, self.timeout_s = dims, rc, cfg, disk_dir, timeout_s
        self.fp8, self.max_retries, self.generation = rc.weights == "fp8", max_retries, 0
        self.src_rank = int(dims.grid[dims.pp_rank, 0, 0])
        self.is_source, self.in_stage = dims.rank == self.src_rank, dims.dp_rank == 0
        self.broadcaster, self.begun, self.last, self.summary = None, set(), {}, {}
        self.launch = os.urandom(LAUNCH_BYTES).hex()  # rank 0's names every version this launch pushes
        self.client = client
        if rc.transport == "local" and dims.world_size > 1:
            raise ValueError(f"rollout.transport=local hands tensors to embedded servers inside one process; this "
                             f"trainer has {dims.world_size} ranks (use tensor, distributed or disk)")
        self._learn_servers()
        if dims.rank == 0:
            self._clear_stale_sessions()
        if rc.transport == "distributed":
            self._open_groups()

    def tag(self, version: int) -> str:
        """The weight version the servers report after push `version`: `{version}-{launch nonce}`. A fresh
        server reports its own initial version ("0" embedded, "default" SGLang), so a server restarted between
        the first push (version 0) and step 1 is told apart from the pushed weights (`check_versions`); so is a
        server that another launch pushed the same step into."""
        return f"{version}-{self.launch}"

    # ------------------------------------------------------------------ servers and groups
    def _clear_stale_sessions(self):
        """A previous launch killed mid-push left a server paused inside an open update session: end it (else
        every push of this launch is refused) and let the server generate again."""
        ended = [u for u in self.client.urls if end_stale_session(self.client, u)]
        if ended:
            print(f"ended the weight-update session a previous launch left open on {', '.join(ended)}", flush=True)
            self.client.continue_generation()

    def _learn_servers(self):
        """Rank 0 tells every rank the servers and their kind; each source gets a client of its own."""
        c = self.client
        box = [{"urls": c.urls, "api_key": c.api_key, "embedded": [c.is_embedded(u) for u in c.urls]}
               if self.dims.rank == 0 else None]
        if self.dims.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=self.dims.side_group)
        info = box[0]
        if self.dims.rank != 0 and self.is_source:
            self.client = SGLangClient(info["urls"], api_key=info["api_key"],
                                       update_timeout=self.rc.update_timeout_s)
        self.embedded = [u for u, e in zip(info["urls"], info["embedded"]) if e]
        self.real = [u for u, e in zip(info["urls"], info["embedded"]) if not e]

    def _in_turn(self, fn):
        """Run fn on the source of each stage in turn; every rank learns every stage's error (-> PushFailed)."""
        for s in range(self.dims.pp):
            err = ""
            if self.dims.pp_rank == s and self.in_stage:
                try:
                    fn()
                except Exception as e:  # shared below so that every rank stops together
                    err = f"stage {s} (rank {self.dims.rank}): {type(e).__name__}: {e}"
            errs = self._all(err)
            if any(errs):
                raise PushFailed("; ".join(e for e in errs if e), self._failed_urls(errs))

    def _all(self, obj) -> list:
        if self.dims.world_size == 1:
            return [obj]
        out = [None] * self.dims.world_size
        dist.all_gather_object(out, obj, group=self.dims.side_group)
        return out

    def _failed_urls(self, errs) -> list:
        urls = self.client.urls if self.client is not None else []
        return sorted({u for u in urls for e in errs if e and u in e})

    def _open_groups(self):
        host, _, port = self.rc.sync_addr.rpartition(":")
        # NCCL between GPUs; gloo on CPUs and for ranks sharing one GPU (an embedded server's receivers sit on it too)
        backend = "nccl" if self.dims.device.type == "cuda" and not self.dims.colocate else "gloo"

        def open_mine():
            if self.is_source:
                s = self.dims.pp_rank
                self.broadcaster = Broadcaster(self.client, source_host(host, self.client.urls),
                                               int(port) + s + self.dims.pp * self.generation, backend,
                                               GROUP.format(stage=s), timeout_s=self.timeout_s,
                                               device=self.dims.device)
        self._in_turn(open_mine)

    def reconnect(self, restarted: bool = False):
        """Drop and re-create every stage's group (a server restarted, or a push broke a group). `restarted`:
        the servers are fresh processes, so what was remembered of them goes too (the last verified push, the
        baseline of the change-set checks); a session still open on one that did not restart is ended."""
        if restarted:
            if self.dims.rank == 0:
                self._guard(self._clear_stale_sessions)   # a server still gone: the push itself names it
            self.last, self.begun = {}, set()
        if self.broadcaster is not None:
            self.broadcaster.close()
            self.broadcaster = None
        if self.client is not None:
            for u in self.client.urls:
                self.client.forget(u)
        self.generation += 1
        self._learn_servers()
        if self.rc.transport == "distributed":
            self._open_groups()

    # ------------------------------------------------------------------ push
    def push(self, state, version: int) -> dict:
        """Full push of this rank's `(official name, tensor)` pairs (`state`: an iterable, or a callable
        returning one, called again on a retry). Collective. Returns rank 0's summary ({} elsewhere)."""
        for attempt in range(self.max_retries + 1):
            try:
                out = self._push_once(state() if callable(state) else state, version)
                self._prune_disk(version)
                return out
            except PushFailed as e:
                if attempt == self.max_retries or not callable(state):
                    raise PushFailed(f"weight push v{version} failed after {attempt + 1} attempt(s); servers "
                                     f"left paused: {e.servers or 'see the error'}: {e}", e.servers) from e
                self.reconnect()   # a group that cannot be re-created raises PushFailed on every rank too

    def _push_once(self, state, version: int) -> dict:
        d, rank0 = self.dims, self.dims.rank == 0
        ok = [""]
        if rank0:
            ok = [self._guard(self._open_update)]
        if any(self._all(ok[0])):
            raise PushFailed(ok[0], self._failed_urls(ok))
        named = list(state) if self.in_stage else []   # references to this rank's tensors, no copies
        ledger = Ledger(d.pp_rank)
        self._in_turn(lambda: self._send_stage(named, ledger, version))
        ledgers = self._gather(ledger)
        res = [self._guard(lambda: self._close_update(ledgers, version)) if rank0 else ""]
        errs = self._all(res[0])
        if any(errs):
            raise PushFailed(next(e for e in errs if e), self._failed_urls(errs))
        return self.summary if rank0 else {}

    def _prune_disk(self, version: int):
        """Disk transport, after a verified push (every rank knows it): each source deletes its stage's older
        pushes (`{disk_dir}/v*/pp{s}`, then the emptied `v*`), so `sync/` holds one copy of the weights, not
        one per step. A failed push never gets here: the servers' last good push stays."""
        if self.rc.transport != "disk" or not self.is_source or not os.path.isdir(self.disk_dir):
            return
        for v in os.listdir(self.disk_dir):
            if v.startswith("v") and v != f"v{version}":
                shutil.rmtree(os.path.join(self.disk_dir, v, f"pp{self.dims.pp_rank}"), ignore_errors=True)
                try:
                    os.rmdir(os.path.join(self.disk_dir, v))  # the last stage out removes the version's folder
                except OSError:
                    pass

    def _guard(self, fn) -> str:
        try:
            fn()
            return ""
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    def _open_update(self):
        c = self.client
        c.pause_generation("retract")
        c.flush_cache()
        for u in c.urls:
            if u not in self.begun:   # a retried push keeps the session its failed attempt opened
                c.begin_update(u)
                self.begun.add(u)

    def _gather(self, ledger):
        if self.dims.world_size == 1:
            return [ledger]
        out = [None] * self.dims.world_size if self.dims.rank == 0 else None
        dist.gather_object(ledger, out, dst=0, group=self.dims.side_group)
        return out

    # ------------------------------------------------------------------ one stage
    def _buckets(self, named):
        """This rank's buckets of the stage, in send order (the source) or its expert sub-buckets (others)."""
        d, cfg, size = self.dims, self.cfg, self.rc.bucket_bytes
        dense = [(n, t) for n, t in named if not is_expert_param(n)]
        experts = [(n, t) for n, t in named if is_expert_param(n)]
        if self.is_source:
            yield from stream_buckets(dense, cfg, fp8=self.fp8, bucket_bytes=size)
        if d.ep == 1:
            yield from stream_buckets(experts, cfg, fp8=self.fp8, bucket_bytes=size)
            return
        per = len(expert_range(cfg.n_routed_experts, d.ep, 0))
        for sub in stream_buckets(experts, cfg, fp8=self.fp8, bucket_bytes=max(1, size // d.ep)):
            parts = None
            if self.is_source:  # one buffer, the parts are views of it: the bucket needs no concatenation
                buf = torch.empty(sub.nbytes * d.ep, dtype=torch.uint8, device=sub.flat.device)
                parts = list(buf.view(d.ep, sub.nbytes).unbind(0))
            if d.staging is not None:   # ranks sharing one GPU over gloo: through host buffers (parallel.colocate)
                d.staging.gather(sub.flat, parts, self.src_rank, d.ep_group)
            else:
                dist.gather(sub.flat, parts, dst=self.src_rank, group=d.ep_group)
            if self.is_source:
                yield FlatBucket.concat([FlatBucket(p, sub.slots).renamed(
                    lambda n, e=e: shift_expert(n, e * per - d.ep_rank * per)) for e, p in enumerate(parts)])

    def _send_stage(self, named, ledger: Ledger, version: int):
        sender, err = (_Sender(self, version) if self.is_source else None), None
        for fb in self._buckets(named):   # a failed source keeps draining: its EP ranks still gather into it
            if sender is None or err is not None:
                continue
            try:
                self._record(fb, ledger)
                sender.start(fb)          # bucket k goes out; the loop builds k+1 meanwhile
            except Exception as e:
                err = e
                sender.abandon()
        if sender is not None and err is None:
            sender.close()
        if err is not None:
            raise err

    def _record(self, fb, ledger: Ledger):
        named = fb.tensors()
        st = LoaderState()
        st.load(named)          # a bucket that splits an atomic pair fails here, before it is sent
        ledger.names += [n for n, _ in named]
        ledger.buckets += 1
        ledger.bytes += fb.nbytes
        if self.embedded:
            ledger.loader.update(st.checksums())
        if self.real:
            ledger.sglang.update(sglang_partials(st.params, self.cfg.n_routed_experts))

    # ------------------------------------------------------------------ close and verify (rank 0)
    def _close_update(self, ledgers, version: int):
        c = self.client
        for u in c.urls:
            c.end_update(u)
            self.begun.discard(u)
        checks = self._verify(ledgers) if self.rc.verify else {}
        c.update_weight_version(self.tag(version))
        c.continue_generation()
        c.weight_version = self.tag(version)
        src = [L for L in ledgers if L.buckets]
        self.summary = {"version": version, "buckets": sum(L.buckets for L in src), "bytes": sum(L.bytes for L in src),
                        "tensors": sum(len(L.names) for L in src), "verified": checks,
                        "bytes_per_source": {L.stage: L.bytes for L in src},
                        "layout_sha": layout_digest({k: v for L in src for k, v in L.loader.items()})}

    def _verify(self, ledgers) -> dict:
        sent = [n for L in ledgers for n in L.names]
        want, seen, doubled = expected_names(self.cfg, self.fp8), set(), set()
        for n in sent:
            (doubled if n in seen else seen).add(n)
        missing, extra = sorted(want - seen), sorted(seen - want)
        if missing or doubled or extra:
            where = {n: [L.stage for L in ledgers if n in L.names] for n in sorted(doubled)[:4]}
            raise PushFailed(f"push manifest: {len(missing)} missing {missing[:6]}, {len(doubled)} sent twice "
                             f"{sorted(doubled)[:6]} (stages {where}), {len(extra)} unexpected {extra[:6]}")
        checks = {}
        loader = {k: v for L in ledgers for k, v in L.loader.items()}
        for u in self.embedded:
            compare_checksums(loader, self.client.weights_checksums(u), u, full_push=True)
            checks[u] = "checksums"
        partials = {k: v for L in ledgers for k, v in L.sglang.items()}
        ours = sglang_checksums(partials)
        for u in self.real:
            checks[u] = verify_real_server(self.client, u, ours, self.last.get(u))
            self.last[u] = checks[u].pop("state")
        return checks


class _Sender:
    """A source's side of one stage: bucket k on the wire (or being written) while the caller builds k+1."""

    def __init__(self, pusher: StagePusher, version: int):
        self.p, self.pending, self.index = pusher, None, 0
        self.transport, self.client = pusher.rc.transport, pusher.client
        if self.transport == "disk":
            if not pusher.disk_dir:
                raise ValueError("transport='disk' needs disk_dir")
            self.dir = os.path.join(pusher.disk_dir, f"v{version}", f"pp{pusher.dims.pp_rank}")
            shutil.rmtree(self.dir, ignore_errors=True)   # a retried or resumed push starts from an empty one
            os.makedirs(self.dir)

    def start(self, fb):
        self.finish()
        if self.transport == "distributed":
            self.pending = (fb, self.p.broadcaster.send_async(fb, None))
        elif self.transport in SENDERS:
            errors, send = [], SENDERS[self.transport]

            def post():
                try:
                    send(self.client, fb, None)
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")
            th = threading.Thread(target=post, daemon=True)
            th.start()
            self.pending = (fb, (th, errors))
        else:
            write_disk_bucket(self.dir, self.index, fb)
        self.index += 1

    def finish(self):
        if self.pending is None:
            return
        _, handle = self.pending
        self.pending = None
        if self.transport == "distributed":
            self.p.broadcaster.finish(handle)
        else:
            th, errors = handle
            th.join()
            if errors:
                raise RuntimeError(f"update_weights_from_tensor failed: {errors}")

    def close(self):
        self.finish()
        if self.transport == "disk":
            for u in self.client.urls:
                self.client.update_weights_from_disk(u, self.dir, None)

    def abandon(self):
        try:
            self.finish()
        except Exception:  # the error that made us abandon is the one reported
            pass
