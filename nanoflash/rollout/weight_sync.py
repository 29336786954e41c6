"""Weight sync: trainer model -> byte-size buckets of (SGLang name, tensor) -> live rollout servers.

The stream (`iter_sglang_buckets`), per tensor of `model.state_dict()` (parameters *and* buffers, so the
hash-routing table `ffn.gate.tid2eid` travels too; MTP is skipped, SGLang's main model ignores it):

    rename      official name -> SGLang HF-style name                           (layout.to_sglang)
    quantize    fp8=True and SGLang serves it FP8: per 128x128 block  S = max(amax, 1e-10)/448 (fp32),
                Q = e4m3(clamp(W * (1/S), +-448)); sent as X.weight (e4m3) + X.weight_scale_inv (S)
                (Miles' Hopper convention, `quant.quantize_fp8_block(fmt="fp32")`); everything else keeps
                the release's storage (bf16 norms/embed/head/compressors/wo_a/weights_proj, fp32 mHC, sinks,
                ape, gate bias, int64 tid2eid). fp8=False sends the trainer's own dtypes (true on-policy).
    bucket      units (an atomic pair with its scales: wq_a+wkv, compressor wkv+wgate, indexer-compressor
                wkv+wgate; else one weight with its scale) packed up to `bucket_bytes` (scales counted; a unit
                larger than the limit goes alone); inside a bucket tensors are sorted by element size,
                largest first, so every byte offset of a flattened mixed-dtype bucket is aligned.

The push (`push_weights`), per SGLang's documented order (rl_and_sglang.md §4.2, §8 item 4):

    pause_generation -> flush_cache -> [begin_weight_update | post_process_weights(restore)] ->
    buckets (from_tensor | from_distributed + broadcast | from_disk) ->
    [end_weight_update | post_process_weights(quantize)] -> continue_generation ; weight_version += 1
    then verify: /weights_checker checksums == the loader layout derived here from what was sent
    (embedded servers; real SGLang servers are only compared with each other, see `verify_push`).

Transports: "tensor" sends a safetensors payload (the embedded server's safe encoding; real SGLang needs its
own pickled `FlattenedTensorBucket` of CUDA tensors, built by `sglang_flattened_payload` when SGLang is
installed); "distributed" joins a gloo/NCCL group as rank 0 and broadcasts each tensor while the server's
`/update_weights_from_distributed` call receives it (gloo moves raw bytes, NCCL the real dtype: SGLang 0.5.16's
`model_runner_components/weight_updater.py` allocates `torch.empty(shape, dtype)` per name and broadcasts each
from rank 0, in order); "disk"
writes one safetensors file per bucket and calls `/update_weights_from_disk`.

Not done here: gathering a PP/EP-sharded model (`dims` must be None: one process holds every tensor).

Tests: `pytest tests/test_weight_sync.py tests/test_rollout_server.py -q`.
"""
from __future__ import annotations

import base64
import datetime
import json
import os
import struct
import threading

import safetensors.torch
import torch
import torch.distributed as dist

from nanoflash.checkpoint_names import storage_kind
from nanoflash.quant import quantize_fp8_block
from nanoflash.rollout.layout import compare_checksums, expected_checksums, sglang_fp8, to_sglang

SAFE_FORMAT = "nanoflash_safetensors"   # load_format of the embedded server's safe tensor payload
# atomic units: official suffixes that must share a bucket (their scales ride along)
ATOMIC = [("attn.wq_a.weight", "attn.wkv.weight"),
          ("attn.compressor.wkv.weight", "attn.compressor.wgate.weight"),
          ("attn.indexer.compressor.wkv.weight", "attn.indexer.compressor.wgate.weight")]
_UNIT_OF = {s: i for i, pair in enumerate(ATOMIC) for s in pair}
# release storage kind -> dtype pushed in an FP8 deployment when SGLang keeps it unquantized (wo_a: bf16)
_KIND_DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64, "fp8": torch.bfloat16,
               "fp4": torch.bfloat16}


# ---------------------------------------------------------------------------------------------- stream
def convert_tensor(name: str, t: torch.Tensor, cfg, fp8: bool) -> list:
    """One trainer tensor -> [(sglang name, tensor)] (+ its weight_scale_inv when quantized)."""
    hf = to_sglang(name)
    t = t.detach()
    if fp8 and sglang_fp8(name, cfg):
        q, s = quantize_fp8_block(t, fmt="fp32")
        return [(hf, q), (hf + "_scale_inv", s)]
    if fp8:
        kind = storage_kind(name, cfg)
        return [(hf, t.to(_KIND_DTYPE.get(kind, t.dtype)))]
    return [(hf, t)]


def _units(model, fp8: bool):
    """Yield lists of converted (name, tensor) that must travel in one bucket, in state_dict order."""
    cfg, waiting = model.cfg, {}
    for name, t in model.state_dict().items():
        if name.startswith("mtp."):
            continue
        parts = name.split(".")
        suffix = ".".join(parts[2:]) if parts[0] == "layers" else name
        if suffix in _UNIT_OF:
            key = (".".join(parts[:2]), _UNIT_OF[suffix])
            waiting.setdefault(key, []).append(convert_tensor(name, t, cfg, fp8))
            if len(waiting[key]) == 2:
                yield [x for conv in waiting.pop(key) for x in conv]
        else:
            yield convert_tensor(name, t, cfg, fp8)
    if waiting:
        raise ValueError(f"model lacks the partner of atomic-pair tensors: {sorted(waiting)}")


def _order(bucket: list) -> list:
    """Largest element size first (stable), so offsets in a flattened bucket stay aligned."""
    return sorted(bucket, key=lambda nt: -nt[1].element_size())


def iter_sglang_buckets(model, dims=None, *, fp8: bool, bucket_bytes: int):
    """Yield buckets `[(name, tensor), ...]` exactly as pushed. One process (`dims=None`) yields everything."""
    if dims is not None:
        raise NotImplementedError(f"iter_sglang_buckets: gathering a sharded model (dims={dims}) is not "
                                  "implemented; pass the full model in one process (dims=None)")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket, size = [], 0
    with torch.no_grad():
        for unit in _units(model, fp8):
            nbytes = sum(t.numel() * t.element_size() for _, t in unit)
            if bucket and size + nbytes > bucket_bytes:
                yield _order(bucket)
                bucket, size = [], 0
            bucket += unit
            size += nbytes
    if bucket:
        yield _order(bucket)


iter_rollout_weights = iter_sglang_buckets  # the name style.md habit 13 uses


# ---------------------------------------------------------------------------------------------- encodings
def encode_tensors(named: list) -> str:
    """[(name, tensor)] -> base64 safetensors with the send order in the metadata (no pickle anywhere)."""
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tensor names in one payload: {sorted({n for n in names if names.count(n) > 1})}")
    blob = safetensors.torch.save({n: t.detach().cpu().contiguous() for n, t in named},
                                  metadata={"order": json.dumps(names)})
    return base64.b64encode(blob).decode()


def decode_tensors(payload: str) -> list:
    """Inverse of `encode_tensors`; any malformed input raises ValueError naming what is wrong."""
    try:
        blob = base64.b64decode(payload, validate=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"tensor payload is not base64: {e}") from e
    return decode_blob(blob)


def decode_blob(blob: bytes) -> list:
    """safetensors bytes -> [(name, tensor)] in the sender's order."""
    if len(blob) < 8:
        raise ValueError(f"tensor payload of {len(blob)} bytes is too short for safetensors")
    (hlen,) = struct.unpack("<Q", blob[:8])
    if hlen > len(blob) - 8:
        raise ValueError("tensor payload is not safetensors (looks like a pickle or is truncated); the embedded "
                         f"server accepts load_format={SAFE_FORMAT!r} only and never unpickles")
    try:
        header = json.loads(blob[8:8 + hlen])
        tensors = safetensors.torch.load(blob)
        order = json.loads(header.get("__metadata__", {}).get("order", "null")) or sorted(tensors)
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"tensor payload is not valid safetensors: {e}") from e
    if sorted(order) != sorted(tensors):
        raise ValueError(f"payload order metadata lists {len(order)} names for {len(tensors)} tensors")
    return [(n, tensors[n]) for n in order]


def sglang_flattened_payload(bucket: list, tp_size: int = 1) -> dict:
    """The request real SGLang takes: one pickled FlattenedTensorBucket per TP rank (needs sglang + CUDA)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    fb = FlattenedTensorBucket(named_tensors=bucket)
    data = {"flattened_tensor": fb.get_flattened_tensor(), "metadata": fb.get_metadata()}
    s = MultiprocessingSerializer.serialize(data, output_str=True)
    return {"serialized_named_tensors": [s] * tp_size, "load_format": "flattened_bucket"}


# ---------------------------------------------------------------------------------------------- transports
def join_group(master_address: str, master_port: int, rank: int, world: int, group_name: str, backend: str,
               timeout_s: float, device=None):
    """A process group of its own (no default group needed): rank 0 hosts the TCP store. -> (pg, store)"""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world, timeout), store
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device or "cuda"))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts), store
    raise ValueError(f"backend must be gloo or nccl, got {backend!r}")


def broadcast_tensor(pg, backend: str, t: torch.Tensor, opts) -> None:
    """Rank 0's side. gloo moves the raw bytes (any dtype); NCCL moves the real dtype, as SGLang receives it."""
    buf = t.detach().contiguous()
    if backend == "gloo":
        buf = buf.cpu().reshape(-1).view(torch.uint8)                           # [nbytes]
    elif not buf.is_cuda:
        buf = buf.cuda()
    pg.broadcast([buf], opts).wait()


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


class Broadcaster:
    """Trainer side of `update_weights_from_distributed`: rank 0 of a group with every server's ranks."""

    def __init__(self, client, master_address: str, master_port: int, backend: str = "gloo",
                 group_name: str = "nanoflash_sync", ranks_per_server: int = 1, timeout_s: float = 120.0,
                 device=None):
        self.client, self.backend, self.group_name = client, backend, group_name
        world = 1 + ranks_per_server * len(client.urls)
        errors = []

        def join(url, offset):
            try:
                client.init_weights_update_group(url, master_address, master_port, offset, world,
                                                 group_name, backend)
            except Exception as e:  # reported below, after our own side gave up or finished
                errors.append(f"{url}: {e}")
        threads = [threading.Thread(target=join, args=(u, 1 + i * ranks_per_server), daemon=True)
                   for i, u in enumerate(client.urls)]
        for th in threads:
            th.start()
        self.pg, self._store = join_group(master_address, master_port, 0, world, group_name, backend,
                                          timeout_s, device)
        for th in threads:
            th.join()
        if errors:
            raise RuntimeError(f"init_weights_update_group failed: {errors}")

    def send(self, bucket: list, weight_version: str):
        body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                "flush_cache": False, "weight_version": str(weight_version)}
        errors, threads = [], []
        for url in self.client.urls:
            def call(url=url):
                try:
                    self.client.post(url, "/update_weights_from_distributed", body)
                except Exception as e:
                    errors.append(f"{url}: {e}")
            threads.append(threading.Thread(target=call, daemon=True))
            threads[-1].start()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for _, t in bucket:
            broadcast_tensor(self.pg, self.backend, t, opts)
        for th in threads:
            th.join()
        if errors:
            raise RuntimeError(f"update_weights_from_distributed failed: {errors}")


def _send_tensor(client, bucket, version):
    """Embedded servers get the safetensors payload; real SGLang its pickled FlattenedTensorBucket (CUDA IPC)."""
    safe = None
    for url in client.urls:
        if client.is_embedded(url):
            safe = safe or {"serialized_named_tensors": [encode_tensors(bucket)], "load_format": SAFE_FORMAT}
            body = safe
        else:
            tp = int(client.get(url, "/get_server_info").get("tp_size", 1))
            body = sglang_flattened_payload(bucket, tp)
        client.post(url, "/update_weights_from_tensor", dict(body, flush_cache=False, weight_version=str(version)))


def _send_disk(client, buckets, version, directory):
    os.makedirs(directory, exist_ok=True)
    for i, bucket in enumerate(buckets):
        blob = base64.b64decode(encode_tensors(bucket))
        with open(os.path.join(directory, f"bucket-{i:05d}.safetensors"), "wb") as f:
            f.write(blob)
    for url in client.urls:
        client.update_weights_from_disk(url, directory, str(version))


def push_weights(client, buckets, *, version=None, transport: str = "tensor", broadcaster=None,
                 disk_dir: str | None = None, verify: bool = True, full_push: bool = True,
                 pause_mode: str = "retract") -> dict:
    """The full update protocol on every server of `client`; returns {"buckets", "tensors", "checksums"}.

    `version`: the weight_version the servers report afterwards (default: the client's counter, bumped).
    `verify`: compare each server's `/weights_checker` checksums with the layout derived from `buckets`;
    `full_push`: the buckets are the whole model, so a tensor the server holds but was not sent is an error."""
    buckets = [list(b) for b in buckets]
    if version is None:
        client.weight_version += 1
        version = client.weight_version
    if transport not in ("tensor", "distributed", "disk"):
        raise ValueError(f"transport must be tensor|distributed|disk, got {transport!r}")
    client.pause_generation(pause_mode)
    try:
        client.flush_cache()
        for url in client.urls:
            client.begin_update(url)
        if transport == "tensor":
            for b in buckets:
                _send_tensor(client, b, version)
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
    return {"buckets": len(buckets), "tensors": sum(len(b) for b in buckets), "checksums": expected,
            "verified": verified}


def verify_push(client, expected: dict, full_push: bool = True) -> list:
    """Embedded servers: their checksums must equal the layout derived here (sha256 of the same bytes).
    Real SGLang hashes its own way (a Triton hash of dequantized bf16 on GPU), which the trainer cannot
    reproduce; there every server must at least report the same checksums as the others. -> [(url, how)]"""
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
