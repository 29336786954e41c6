"""Transports: the push of a weight stream (`buckets.py`) into live rollout servers, and its verification.

The push of one process (`push_weights`), per SGLang's documented order (rl_notes §4.2, §8 item 4):

    pause_generation -> flush_cache -> [begin_weight_update | post_process_weights(restore)] ->
    buckets (from_tensor | from_distributed + broadcast | from_disk) ->
    [end_weight_update | post_process_weights(quantize)] -> continue_generation ; weight_version += 1
    then verify: /weights_checker checksums == the loader layout derived here from what was sent.

Transports: "tensor" sends a safetensors payload to the embedded server and SGLang's own pickled
`FlattenedTensorBucket` of the (GPU) flat buffer to real SGLang (`sglang_flattened_payload`: CUDA IPC, so one
host only); "local" hands an embedded server in the trainer's own process a handle to the tensors
(`buckets.hand_over`: no serialization, the GPU tensors as they are, the same HTTP calls around them); "distributed" (`Broadcaster`) is rank 0 of a gloo/NCCL group with every receiving rank of every
server (as many per server as it reports: SGLang joins `rank_offset + tp_rank`) and broadcasts while the
server's `/update_weights_from_distributed` call receives: one flat uint8 buffer per bucket with
load_format="flattened_bucket" where the server supports it (SGLang >= 0.5.16's
`_update_bucketed_weights_from_distributed`, and the embedded server), else one broadcast per tensor in
order (gloo moves raw bytes, NCCL the real dtype); "disk" writes one safetensors file per bucket and calls
`/update_weights_from_disk`.

A sharded trainer (PP x EP) pushes with `push.StagePusher`: one source per pipeline stage, built on the
pieces here.

Tests: `pytest tests/test_weight_sync.py tests/test_weight_sync_stage.py tests/test_rollout_server.py -q`.
"""
from __future__ import annotations

import datetime
import os
import re
import socket
import threading

import torch
import torch.distributed as dist

from nanoflash.names import official_inventory, to_sglang
from nanoflash.config import TRANSPORTS
from nanoflash.sglang.client import RequestRejected
from nanoflash.sglang.layout import compare_checksums, expected_checksums, sglang_fp8
from nanoflash.sglang.buckets import (ATOMIC, FLAT_FORMAT, LOCAL_FORMAT, SAFE_FORMAT, FlatBucket, Item,  # noqa: F401
                                      Slot, convert_items, decode_blob, decode_tensors, drop_handed, encode_blob,
                                      encode_tensors, hand_over, iter_units, named_of, pack_units, stream_buckets,
                                      take_over)


def iter_sglang_buckets(model, dims=None, *, fp8: bool, bucket_bytes: int):
    """Yield buckets `[(name, tensor), ...]` exactly as pushed, for a model held whole by one process."""
    if dims is not None and getattr(dims, "world_size", 1) > 1:
        raise ValueError(f"iter_sglang_buckets streams one process's model; a sharded trainer ({dims}) pushes "
                         "through push.StagePusher, one source per pipeline stage")
    for fb in stream_buckets(model.state_dict().items(), model.cfg, fp8=fp8, bucket_bytes=bucket_bytes):
        yield fb.tensors()


def sglang_flattened_payload(bucket, tp_size: int = 1) -> dict:
    """The request real SGLang takes: one pickled FlattenedTensorBucket per TP rank (needs sglang; CUDA IPC).
    A `FlatBucket` is wrapped as it is (its GPU buffer, no copy); a list is flattened by SGLang's class."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
    if isinstance(bucket, FlatBucket):
        meta = [FlattenedTensorMetadata(s.name, torch.Size(s.shape), s.dtype, s.start, s.end, s.end - s.start)
                for s in bucket.slots]
        fb = FlattenedTensorBucket(flattened_tensor=bucket.flat, metadata=meta)
    else:
        fb = FlattenedTensorBucket(named_tensors=bucket)
    data = {"flattened_tensor": fb.get_flattened_tensor(), "metadata": fb.get_metadata()}
    s = MultiprocessingSerializer.serialize(data, output_str=True)
    return {"serialized_named_tensors": [s] * tp_size, "load_format": FLAT_FORMAT}


# ---------------------------------------------------------------------------------------------- transports
# SGLang 0.5.16 joins an update group in `init_custom_process_group` (python/sglang/srt/utils/common.py L2424-2492),
# called by `WeightUpdater.init_weights_update_group` (srt/model_executor/model_runner_components/weight_updater.py
# L48-92) with init_method=NetworkAddress(master_address, master_port).to_tcp(), rank=rank_offset + tp_rank,
# world_size, group_name, backend and no timeout (torch's default_pg_timeout, 30 min):
#     store, rank, world = next(rendezvous("tcp://host:port", rank, world, timeout)); store.set_timeout(timeout)
#     store = PrefixStore(group_name, store)
#     pg, _ = _new_process_group_helper(world, rank, [], Backend(backend), store, group_name=group_name,
#                                       backend_options=None (pg_options before torch 2.6), timeout=timeout,
#                                       device_id=None)
#     _world.pg_group_ranks[pg] = {i: i for i in range(world)}
# torch's helper nests two more prefixes, "<group_name>/" and "<device>/" (gloo: its one backend under "cpu/";
# NCCL: "cuda/"), and refuses a group name this process already created (so SGLang refuses a re-init of a name
# until /destroy_weights_update_group). `join_group` makes the same calls; tests/test_update_group_sglang.py meets
# a copy of SGLang's function written from its source.
_OPTIONS_KW = "backend_options" if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 6) \
    else "pg_options"   # renamed in torch 2.6 (SGLang picks the name the same way)


def tcp_url(host: str, port: int) -> str:
    """SGLang's `NetworkAddress.to_tcp()`: tcp://host:port, an IPv6 host in brackets."""
    return f"tcp://[{host}]:{int(port)}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{int(port)}"


def _rendezvous(url: str, host: str, port: int, rank: int, world: int, timeout) -> tuple:
    """torch's `rendezvous(url, rank, world, timeout)`, as SGLang calls it, for the servers' ranks. Rank 0 (the
    trainer's source) hosts the group's store itself (`master_store`: torch's would listen on every interface).
    Under torchrun (the trainer's launcher, and embedded servers' ranks in its processes) torch's tcp:// handler
    would make every rank a client of torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE): there a plain
    client of the group's store is built instead."""
    from torch.distributed.rendezvous import _torchelastic_use_agent_store, rendezvous
    if rank == 0:
        return master_store(host, port, world, timeout), rank, world
    if not _torchelastic_use_agent_store():
        return next(rendezvous(url, rank, world, timeout=timeout))
    return dist.TCPStore(host, int(port), world, is_master=False, timeout=timeout,
                         use_libuv=os.environ.get("USE_LIBUV", "1") == "1"), rank, world


def master_store(host: str, port: int, world: int, timeout) -> dist.TCPStore:
    """The group's TCPStore, hosted by rank 0 and listening on `host` only. torch's master binds the wildcard
    address (every interface, no authentication: any host that reaches the port could write the store), so a
    socket bound to the sync address is handed to it (`master_listen_fd`); otherwise as torch's rendezvous
    builds it (`rendezvous._create_c10d_store`: waits for every rank; libuv unless USE_LIBUV=0)."""
    family, _, _, _, addr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(max(128, world))
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, int(port), world, is_master=True, timeout=timeout, master_listen_fd=sock.detach(),
                         use_libuv=os.environ.get("USE_LIBUV", "1") == "1")


def join_group(master_address: str, master_port: int, rank: int, world: int, group_name: str, backend: str,
               timeout_s: float, device=None, register: bool = True):
    """One member of an update group, built as SGLang 0.5.16 builds its own (see above); rank 0 hosts the TCP store.
    `register=False`: the same store keys and backend without torch's group-name registry (the embedded server's
    ranks, which share a process with each other and often with the trainer, and so cannot each register the
    name). -> (pg, store)"""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    if register and dist.is_initialized() and dist.distributed_c10d._get_default_group().bound_device_id is not None:
        raise ValueError("the default process group is bound to a device (eager NCCL init): torch would split the "
                         "update group from it, which holds none of the servers' ranks; init it without device_id")
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device or "cuda"))
    store, rank, world = _rendezvous(tcp_url(master_address, master_port), master_address, master_port, rank, world,
                                     timeout)
    store.set_timeout(timeout)
    prefixed = PrefixStore(group_name, store)
    if register:
        pg, _ = _new_process_group_helper(world, rank, [], Backend(backend), prefixed, group_name=group_name,
                                          **{_OPTIONS_KW: None}, timeout=timeout, device_id=None)
        _world.pg_group_ranks[pg] = {i: i for i in range(world)}
        return pg, store
    inner = PrefixStore(f"{'cpu' if backend == 'gloo' else 'cuda'}/", PrefixStore(f"{group_name}/", prefixed))
    if backend == "gloo":
        return dist.ProcessGroupGloo(inner, rank, world, timeout), store
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout, opts.is_high_priority_stream = timeout, False
    return dist.ProcessGroupNCCL(inner, rank, world, opts), store


def drop_local_group(group_name: str) -> int:
    """Destroy the groups this process registered under `group_name` (a Broadcaster that was never closed: torch,
    like SGLang's, refuses to create a name twice). -> how many were dropped"""
    from torch.distributed.distributed_c10d import _world
    stale = [pg for pg, name in list(_world.pg_names.items()) if name == group_name]
    for pg in stale:
        dist.destroy_process_group(pg)
    return len(stale)


def leave_group(pg) -> None:
    """Drop a member: a registered one through torch (which frees its name for a later join), others as they are."""
    from torch.distributed.distributed_c10d import _world
    if pg is not None and pg in _world.pg_names:
        dist.destroy_process_group(pg)


def _wire(t: torch.Tensor, backend: str) -> torch.Tensor:
    """What goes into the broadcast: gloo moves raw CPU bytes (any dtype), NCCL the tensor on its GPU."""
    buf = t.detach().contiguous()
    if backend == "gloo":
        return buf.cpu().reshape(-1).view(torch.uint8)                            # [nbytes]
    return buf if buf.is_cuda else buf.cuda()


def broadcast_tensor(pg, backend: str, t: torch.Tensor, opts, async_op: bool = False):
    """Rank 0's side. gloo moves the raw bytes (any dtype); NCCL moves the real dtype, as SGLang receives it."""
    work = pg.broadcast([_wire(t, backend)], opts)
    return work if async_op else work.wait()


def recv_tensor(pg, backend: str, dtype: torch.dtype, shape: list, device, opts) -> torch.Tensor:
    """A receiving rank's side of `broadcast_tensor`."""
    shape = [int(x) for x in shape]
    if backend == "gloo":
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        buf = torch.empty(n, dtype=torch.uint8)
        pg.broadcast([buf], opts).wait()
        return buf.view(dtype).reshape(shape)                                   # [*shape]
    buf = torch.empty(shape, dtype=dtype, device=device)
    pg.broadcast([buf], opts).wait()
    return buf


def join_receivers(master_address: str, master_port: int, ranks, world: int, group_name: str, backend: str,
                   timeout_s: float, device=None) -> list:
    """A server's side of a group: one member per rank in `ranks` (its TP ranks), joined concurrently, each as
    SGLang's scheduler of that TP rank joins (`join_group`: the same rendezvous, store prefixes and backend), none
    registered with torch: SGLang's schedulers are processes of their own, while the embedded servers (and often
    the trainer) of a test share one, whose registry takes a name once. The server refuses a second join of a
    name itself, as SGLang's torch does."""
    ranks, joined = list(ranks), {}
    threads, errors = _threads({f"rank {r}": (lambda r=r: joined.__setitem__(r, join_group(
        master_address, master_port, r, world, group_name, backend, timeout_s, device, register=False)[0]))
        for r in ranks})
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError(f"joining {group_name} failed: {errors}")
    return [joined[r] for r in ranks]


def receive_bucket(pgs: list, backend: str, specs: list, flat: bool, device=None) -> list:
    """Every member receives one bucket (one flat uint8 broadcast, or one per (name, dtype, shape) in order);
    all must get the same bytes. -> [(name, tensor)] of the first member."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    nb = [torch.Size(s).numel() * torch.empty((), dtype=dt).element_size() for _, dt, s in specs]
    ends, out = torch.tensor(nb, dtype=torch.int64).cumsum(0).tolist(), [None] * len(pgs)

    def recv(k):
        if flat:
            buf = recv_tensor(pgs[k], backend, torch.uint8, [sum(nb)], device, opts)
            out[k] = [(n, buf[e - b:e].view(dt).reshape(s)) for (n, dt, s), b, e in zip(specs, nb, ends)]
        else:
            out[k] = [(n, recv_tensor(pgs[k], backend, dt, s, device, opts)) for n, dt, s in specs]
    threads, errors = _threads({f"member {k}": (lambda k=k: recv(k)) for k in range(len(pgs))})
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError(f"receiving a bucket failed: {errors}")
    for k, named in enumerate(out[1:], start=1):
        bad = [n for (n, a), (_, b) in zip(out[0], named)
               if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))]
        if bad:
            raise RuntimeError(f"group member {k} received different bytes for {bad[:4]}")
    return out[0]


def _version(v) -> dict:
    """The weight_version field of an update request; None leaves the server's version as it is."""
    return {} if v is None else {"weight_version": str(v)}


def _threads(calls: dict) -> tuple[list, list]:
    """Run {label: fn} in threads (each blocks until its server is done); -> (threads, errors list)."""
    errors, threads = [], []
    for label, fn in calls.items():
        def run(label=label, fn=fn):
            try:
                fn()
            except Exception as e:  # reported by the caller, after its own side finished or failed
                errors.append(f"{label}: {type(e).__name__}: {e}")
        threads.append(threading.Thread(target=run, daemon=True))
        threads[-1].start()
    return threads, errors


def clear_stale_group(client, url: str, group_name: str) -> bool:
    """A launch's first act on a server: destroy a group of this name a previous launch left (it crashed, or was
    killed, before `close`). SGLang 0.5.16 refuses to init a name it still holds (torch's "group name has already
    been created"), so without this a re-launch against running servers fails until they restart; the embedded
    server refuses the same way. A 400 is the usual answer: no such group. -> whether one was destroyed"""
    try:
        client.post(url, "/destroy_weights_update_group", {"group_name": group_name}, retry_s=0.0)
        return True
    except RequestRejected:
        return False


def end_stale_session(client, url: str) -> bool:
    """A launch's first act on a `session`-protocol server: end a weight-update session a previous launch left
    open (killed between /begin_weight_update and /end_weight_update). The server refuses every later begin
    ("a weight-update session is already open") until it restarts, so without this a re-launch cannot push.
    Ending it re-derives the quantisation state of the half-pushed weights; the launch's first push replaces them
    all. A 400 is the usual answer: no session open. -> whether one was ended"""
    if client.protocol(url) != "session":
        return False
    try:
        client.post(url, "/end_weight_update", {}, retry_s=0.0)
        return True
    except RequestRejected as e:
        if e.status != 400:
            raise
        return False


class Broadcaster:
    """One source of `update_weights_from_distributed`: rank 0 of a group `group_name` with every receiving
    rank of every server. A server's rank count comes from itself (`client.server_ranks`: SGLang joins
    `rank_offset + tp_rank`) unless `ranks_per_server` is given; offsets are cumulative, world = 1 + sum."""

    def __init__(self, client, master_address: str, master_port: int, backend: str = "gloo",
                 group_name: str = "nanoflash_sync", ranks_per_server: int | None = None, timeout_s: float = 120.0,
                 device=None):
        self.client, self.backend, self.group_name = client, backend, group_name
        ranks = [client.server_ranks(u) if ranks_per_server is None else ranks_per_server for u in client.urls]
        self.world, offsets = 1 + sum(ranks), [1 + sum(ranks[:i]) for i in range(len(ranks))]
        self.flat_ok = all(client.supports_flattened(u) for u in client.urls)
        for u in client.urls:
            clear_stale_group(client, u, group_name)
        threads, errors = _threads({u: (lambda u=u, o=o: client.init_weights_update_group(
            u, master_address, master_port, o, self.world, group_name, backend)) for u, o in zip(client.urls, offsets)})
        drop_local_group(group_name)
        try:
            self.pg, self._store = join_group(master_address, master_port, 0, self.world, group_name, backend,
                                              timeout_s, device)
        finally:
            for th in threads:
                th.join()
        if errors:
            raise RuntimeError(f"init_weights_update_group {group_name!r} (world {self.world}) failed: {errors}")

    def send_async(self, bucket, weight_version: str):
        """Post the bucket's names to every server and start the broadcast; `finish` the returned handle."""
        named = named_of(bucket)
        flat = self.flat_ok and isinstance(bucket, FlatBucket)
        body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in named],
                "shapes": [list(t.shape) for _, t in named], "group_name": self.group_name, "flush_cache": False,
                **_version(weight_version), **({"load_format": FLAT_FORMAT} if flat else {})}
        threads, errors = _threads({u: (lambda u=u: self.client.post(u, "/update_weights_from_distributed", body))
                                    for u in self.client.urls})
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        tensors = [bucket.flat] if flat else [t for _, t in named]
        works = [broadcast_tensor(self.pg, self.backend, t, opts, async_op=True) for t in tensors]
        return threads, errors, works

    def finish(self, handle):
        threads, errors, works = handle
        for w in works:
            w.wait()
        for th in threads:
            th.join()
        if errors:
            raise RuntimeError(f"update_weights_from_distributed ({self.group_name}) failed: {errors}")

    def send(self, bucket, weight_version: str):
        self.finish(self.send_async(bucket, weight_version))

    def close(self):
        """Tell every server to drop the group (its ranks leave it), then drop ours."""
        for u in self.client.urls:
            try:
                self.client.post(u, "/destroy_weights_update_group", {"group_name": self.group_name}, retry_s=0.0)
            except Exception:  # the server may be the reason we close; the group dies with our side anyway
                pass
        leave_group(self.pg)  # frees the name in torch's registry: a later Broadcaster may join it again
        self.pg = self._store = None


def send_tensor_payload(client, bucket, version):
    """Embedded servers get the safetensors payload; real SGLang its pickled FlattenedTensorBucket (CUDA IPC)."""
    safe = None
    for url in client.urls:
        if client.is_embedded(url):
            safe = safe or {"serialized_named_tensors": [encode_tensors(named_of(bucket))], "load_format": SAFE_FORMAT}
            body = safe
        else:
            body = sglang_flattened_payload(bucket, client.server_ranks(url))
        client.post(url, "/update_weights_from_tensor", dict(body, flush_cache=False, **_version(version)))


def send_local_payload(client, bucket, version):
    """transport=local: every server is an embedded one in this process; each gets a handle to the bucket's
    tensors as they are (on the GPU in the `gpu` recipe), which its loader copies into its own store."""
    named = named_of(bucket)
    for url in client.urls:
        if not client.is_embedded(url):
            raise ValueError(f"transport=local hands tensors to embedded servers in this process; {url} is not "
                             f"one (use transport=tensor, distributed or disk)")
        handle = hand_over(named)
        try:
            client.post(url, "/update_weights_from_tensor",
                        {"load_format": LOCAL_FORMAT, "handle": handle, "flush_cache": False, **_version(version)})
        finally:
            drop_handed(handle)  # taken by the server, or left by a failed request: never kept


# the transports that post each bucket over HTTP: bytes (tensor) or an in-process handle (local)
SENDERS = {"tensor": send_tensor_payload, "local": send_local_payload}


def write_disk_bucket(directory: str, index: int, bucket) -> None:
    """One safetensors file per bucket, named by its index."""
    with open(os.path.join(directory, f"bucket-{index:05d}.safetensors"), "wb") as f:
        f.write(encode_blob(named_of(bucket)))


def _send_disk(client, buckets, version, directory):
    os.makedirs(directory, exist_ok=True)
    for i, bucket in enumerate(buckets):
        write_disk_bucket(directory, i, bucket)
    for url in client.urls:
        client.update_weights_from_disk(url, directory, str(version))


def push_weights(client, buckets, *, version=None, transport: str = "tensor", broadcaster=None,
                 disk_dir: str | None = None, verify: bool = True, full_push: bool = True,
                 pause_mode: str = "retract") -> dict:
    """The full update protocol on every server of `client`, for buckets one process holds; returns
    {"buckets", "tensors", "checksums", "verified"}. `version`: the weight_version the servers report
    afterwards (default: the client's counter, bumped). `verify`: compare each server's `/weights_checker`
    checksums with the layout derived from `buckets`; `full_push`: a tensor the server holds but was not
    sent is an error. Sharded trainers push with `push.StagePusher` instead."""
    buckets = [named_of(b) for b in buckets]
    if version is None:
        client.weight_version += 1
        version = client.weight_version
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {'|'.join(TRANSPORTS)}, got {transport!r}")
    client.pause_generation(pause_mode)
    try:
        client.flush_cache()
        for url in client.urls:
            client.begin_update(url)
        if transport in SENDERS:
            for b in buckets:
                SENDERS[transport](client, b, version)
        elif transport == "distributed":
            if broadcaster is None:
                raise ValueError("transport='distributed' needs a Broadcaster (init the group once)")
            for b in buckets:
                broadcaster.send(b, version)
        else:
            if not disk_dir:
                raise ValueError("transport='disk' needs disk_dir")
            _send_disk(client, buckets, version, disk_dir)
        for url in client.urls:
            client.end_update(url)
    finally:
        client.continue_generation()
    expected = expected_checksums(buckets)
    verified = verify_push(client, expected, full_push) if verify else []
    client.weight_version = int(version) if str(version).isdigit() else version  # what samples must now carry
    return {"buckets": len(buckets), "tensors": sum(len(b) for b in buckets), "checksums": expected,
            "verified": verified}


def verify_push(client, expected: dict, full_push: bool = True) -> list:
    """Embedded servers: their checksums must equal the layout derived here (sha256 of the same bytes).
    Real SGLang hashes its own way; here every server must at least report the same checksums as the others
    (the per-stage push, `sglang.push`, also reproduces SGLang's own hash). -> [(url, how)]"""
    done, real = [], {}
    for url in client.urls:
        if client.is_embedded(url):
            compare_checksums(expected, client.weights_checksums(url), url, full_push)
            done.append((url, "checksums"))
        else:
            real[url] = client.weights_checksums(url)
    if real:
        first_url, first = next(iter(real.items()))
        for url, sums in real.items():
            compare_checksums(first, sums, f"{url} (vs {first_url})", full_push)
            done.append((url, "consistency" if len(real) > 1 else "none"))
    return done


class PushFailed(RuntimeError):
    """A push did not land; `servers` names who failed (empty: our side)."""

    def __init__(self, message: str, servers=()):
        super().__init__(message)
        self.servers = list(servers)


def expected_names(cfg, fp8: bool) -> set:
    """Every SGLang name a full push of a model of `cfg` must send exactly once (MTP excluded)."""
    out = set()
    for name in official_inventory(cfg):
        if not name.startswith("mtp."):
            out.add(to_sglang(name))
            if fp8 and sglang_fp8(name, cfg):
                out.add(to_sglang(name) + "_scale_inv")
    return out


def verify_real_server(client, url: str, ours: dict, prev) -> dict:
    """A real SGLang server against `ours` ({name: (SGLang hash or None, fingerprint, fp8)}, layout.sglang_checksums):
    TP 1: the exact hash where reproducible (an FP8 tensor must match); otherwise by change sets against the
    previous verified push `prev` (a tensor changed on a rank iff what we sent changed). Raises PushFailed
    naming the server; returns counts and `state` (keep it as the next call's `prev`)."""
    ranks = client.weights_checksums_per_rank(url)
    exact, changes, unchecked, bad = 0, 0, 0, []
    for r, sums in enumerate(ranks):
        for name, (hexval, fprint, fp8) in ours.items():
            got = sums.get(name)
            if got is None:
                bad.append(f"rank {r}: {name} not on the server")
            elif len(ranks) == 1 and hexval is not None and got == hexval:
                exact += 1
            elif len(ranks) == 1 and hexval is not None and fp8:
                bad.append(f"{name}: SGLang hash {got} != ours {hexval}")
            elif prev is not None:
                changes += 1
                moved, sent = got != prev[0][r].get(name), fprint != prev[1].get(name, (None, None))[1]
                if moved != sent:
                    bad.append(f"rank {r}: {name} {'changed' if moved else 'did not change'} on the server, "
                               f"unlike what was sent")
            else:
                unchecked += 1
    if bad:
        raise PushFailed(f"weight push did not land on {url}: {len(bad)} problem(s): {bad[:6]}", [url])
    server_only = sorted(set().union(*ranks) - set(ours))
    return {"exact": exact, "change_sets": changes, "first_push_unchecked": unchecked, "server_only": len(server_only),
            "server_only_names": server_only[:6], "state": (ranks, ours)}


def probe_logprobs(client, model, prompt: list, max_new_tokens: int = 8, url: str | None = None) -> dict:
    """Behavioural check of a push: greedy-generate on the server, score the same tokens with `model`
    (batch of one, T = 1, as the server scores T = 0), return {mean, max} |delta logprob| and the tokens."""
    url = url or client.urls[0]
    g = client.generate(prompt, {"temperature": 0, "max_new_tokens": max_new_tokens}, url=url)[0]
    full = torch.tensor(list(prompt) + g.output_ids)
    with torch.no_grad():
        ref = model.token_logprobs(full[None, :-1], full[None, 1:])[0, len(prompt) - 1:]
    d = (ref - torch.tensor(g.logprobs, dtype=torch.float32)).abs()
    return {"mean": float(d.mean()), "max": float(d.max()), "tokens": g.output_ids, "version": g.weight_version}
