"""The weight stream: trainer tensors -> flattened byte buckets of (SGLang name, tensor), as SGLang loads them.

Per tensor of a (name, tensor) iterator (a model's `state_dict()`, or one rank's shard: parameters *and*
buffers, so the hash-routing table `ffn.gate.tid2eid` travels too; MTP is skipped, SGLang's main model
ignores it):

    rename      official name -> SGLang HF-style name                 (names.to_sglang, the one table)
    quantize    fp8=True and SGLang serves it FP8: per 128x128 block  S = max(amax, 1e-10)/448 (fp32),
                Q = e4m3(clamp(W * (1/S), +-448)); sent as X.weight (e4m3) + X.weight_scale_inv (S)
                (Miles' Hopper convention, `quant.quantize_fp8_block_into`: a Triton kernel on GPU); everything
                else keeps the release's storage (bf16 norms/embed/head/compressors/wo_a/weights_proj, fp32 mHC,
                sinks, ape, gate bias, int64 tid2eid). fp8=False sends the trainer's own dtypes (true on-policy).
    units       what must share a bucket: the atomic pairs SGLang's loader fuses (wq_a+wkv, compressor
                wkv+wgate, indexer-compressor wkv+wgate) and the halves of one fused expert tensor (routed
                expert w1+w3 -> w13, shared w1+w3 -> gate_up_proj), each with its scales; else one weight.
    bucket      units packed up to `bucket_bytes` (a unit larger than the limit goes alone) into ONE flat
                uint8 buffer (`FlatBucket`) on the tensors' own device, tensors back to back, largest element
                size first, so every byte offset is a multiple of its element size with no padding: exactly
                SGLang's `FlattenedTensorBucket` layout. Quantization and casts write straight into it, so a
                bucket costs its own bytes plus the quantizer's bounded scratch.

`stream_buckets(named, cfg)` yields `FlatBucket`s one at a time; `FlatBucket.tensors()` gives [(name, view)].
Payload encodings live here too: the embedded server's safetensors payload (`encode_tensors`, never a pickle),
and the in-process handover (`hand_over` / `take_over`): an embedded server running in the trainer's own
process gets a handle to the bucket's tensors, on their device, instead of their bytes -- the single-process
analogue of SGLang's CUDA-IPC payload (a handle, no copy until the loader's own).

Tests: `pytest tests/test_weight_sync.py -q`.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
import uuid
from typing import NamedTuple

import safetensors.torch
import torch

from nanoflash.names import name_pattern, scale_shape, storage_kind, to_sglang
from nanoflash.quant import quantize_fp8_block_into
from nanoflash.sglang.layout import sglang_fp8

SAFE_FORMAT = "nanoflash_safetensors"   # load_format of the embedded server's safe tensor payload
FLAT_FORMAT = "flattened_bucket"        # SGLang's load_format for one flat uint8 buffer + per-tensor metadata
LOCAL_FORMAT = "nanoflash_in_process"   # load_format of a handle to tensors an in-process server takes as they are
# units: official block suffixes (`#` = expert id) that must share a bucket (their scales ride along)
ATOMIC = [("attn.wq_a.weight", "attn.wkv.weight"),
          ("attn.compressor.wkv.weight", "attn.compressor.wgate.weight"),
          ("attn.indexer.compressor.wkv.weight", "attn.indexer.compressor.wgate.weight"),
          ("ffn.experts.#.w1.weight", "ffn.experts.#.w3.weight"),
          ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight")]
_UNIT_OF = {s: i for i, pair in enumerate(ATOMIC) for s in pair}
# release storage kind -> dtype pushed in an FP8 deployment when SGLang keeps it unquantized (wo_a: bf16)
_KIND_DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64, "fp8": torch.bfloat16,
               "fp4": torch.bfloat16}


# ---------------------------------------------------------------------------------------------- stream
class Item(NamedTuple):
    """One tensor of the stream before it exists: made from `src` by `how` ("q": FP8 payload, "s": its fp32
    scale, "cast": a copy in `dtype`)."""
    name: str
    src: torch.Tensor
    how: str
    dtype: torch.dtype
    shape: tuple

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def convert_items(name: str, t: torch.Tensor, cfg, fp8: bool) -> list[Item]:
    """One trainer tensor (official name) -> its stream items (+ its weight_scale_inv when quantized)."""
    hf, t = to_sglang(name), t.detach()
    if fp8 and sglang_fp8(name, cfg):
        return [Item(hf, t, "q", torch.float8_e4m3fn, tuple(t.shape)),
                Item(hf + "_scale_inv", t, "s", torch.float32, scale_shape("fp8", tuple(t.shape)))]
    return [Item(hf, t, "cast", served_dtype(name, t, cfg) if fp8 else t.dtype, tuple(t.shape))]


def served_dtype(name: str, t: torch.Tensor, cfg) -> torch.dtype:
    """The dtype an FP8 push sends trainer tensor `name` in when SGLang keeps it unquantized: the release's
    storage (bf16 norms/embed/head/compressors, fp32 mHC/sinks/ape/gate bias), else the tensor's own."""
    return _KIND_DTYPE.get(storage_kind(name, cfg), t.dtype)


def unit_key(name: str):
    """(layer prefix, pair index, expert id) if `name` is half of an atomic unit, else None."""
    pat, nums = name_pattern(name)
    if not pat.startswith("layers.#."):
        return None
    pair = _UNIT_OF.get(pat[len("layers.#."):])
    return None if pair is None else (nums[0], pair, tuple(nums[1:]))


def iter_units(named, cfg, fp8: bool):
    """Yield lists of items that must travel in one bucket, in iteration order (MTP skipped)."""
    waiting = {}
    for name, t in named:
        if name.startswith("mtp."):
            continue
        key = unit_key(name)
        if key is None:
            yield convert_items(name, t, cfg, fp8)
            continue
        waiting.setdefault(key, []).append(convert_items(name, t, cfg, fp8))
        if len(waiting[key]) == 2:
            yield [x for conv in waiting.pop(key) for x in conv]
    if waiting:
        raise ValueError(f"the stream lacks the partner of atomic-pair tensors (layer, pair, expert): "
                         f"{sorted(waiting)}")


def pack_units(units, bucket_bytes: int):
    """Greedy byte packing: yield lists of items, each list at most `bucket_bytes` unless one unit is larger."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket, size = [], 0
    for unit in units:
        nbytes = sum(it.nbytes for it in unit)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += unit
        size += nbytes
    if bucket:
        yield bucket


class Slot(NamedTuple):
    """Where one tensor lives in a flat bucket: bytes [start, end)."""
    name: str
    dtype: torch.dtype
    shape: tuple
    start: int
    end: int


class FlatBucket:
    """One bucket laid out as SGLang's `FlattenedTensorBucket`: `flat` [nbytes] uint8, tensor i at bytes
    [slots[i].start, slots[i].end), back to back in slot order, each offset a multiple of its element size."""

    def __init__(self, flat: torch.Tensor, slots: list[Slot]):
        self.flat, self.slots = flat, list(slots)

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    @classmethod
    def layout(cls, items: list[Item]) -> tuple[list[Item], list[Slot]]:
        """Order items largest element size first (stable) and give each its byte range."""
        items = sorted(items, key=lambda it: -torch.empty((), dtype=it.dtype).element_size())
        slots, pos = [], 0
        for it in items:
            slots.append(Slot(it.name, it.dtype, it.shape, pos, pos + it.nbytes))
            pos += it.nbytes
        return items, slots

    @classmethod
    def build(cls, items: list[Item], device=None) -> "FlatBucket":
        """Allocate the flat buffer (on the sources' device) and fill it: casts copy in, FP8 quantizes in."""
        items, slots = cls.layout(items)
        device = device if device is not None else items[0].src.device
        fb = cls(torch.empty(slots[-1].end if slots else 0, dtype=torch.uint8, device=device), slots)
        views = dict(fb.tensors())
        for it in items:
            if it.how == "cast":
                views[it.name].copy_(it.src)
            elif it.how == "q":
                quantize_fp8_block_into(it.src, views[it.name], views[it.name + "_scale_inv"])
        return fb

    def tensors(self) -> list:
        """[(name, tensor view into `flat`)] in byte order."""
        return [(s.name, self.flat[s.start:s.end].view(s.dtype).view(s.shape)) for s in self.slots]

    def renamed(self, fn) -> "FlatBucket":
        """The same bytes under other names (expert ids of another EP rank)."""
        return FlatBucket(self.flat, [s._replace(name=fn(s.name)) for s in self.slots])

    @classmethod
    def concat(cls, parts: list["FlatBucket"]) -> "FlatBucket":
        """One bucket of several (an EP gather): their bytes back to back, re-packed only if an offset would
        break the element-size alignment (never for expert buckets of even-sized matrices)."""
        slots, pos = [], 0
        for p in parts:
            slots += [s._replace(start=s.start + pos, end=s.end + pos) for s in p.slots]
            pos += p.nbytes
        es = lambda dt: torch.empty((), dtype=dt).element_size()  # noqa: E731
        if all(s.start % es(s.dtype) == 0 for s in slots):
            return cls(torch.cat([p.flat for p in parts]) if len(parts) > 1 else parts[0].flat, slots)
        items = [Item(n, t, "cast", t.dtype, tuple(t.shape)) for p in parts for n, t in p.tensors()]
        return cls.build(items)


def stream_buckets(named, cfg, *, fp8: bool, bucket_bytes: int, device=None):
    """Yield `FlatBucket`s of the (official name, tensor) iterator `named`, one at a time."""
    with torch.no_grad():
        for items in pack_units(iter_units(named, cfg, fp8), bucket_bytes):
            yield FlatBucket.build(items, device)


# ---------------------------------------------------------------------------------------------- encodings
def named_of(bucket) -> list:
    """A bucket as [(name, tensor)], whether it is a `FlatBucket` or already such a list."""
    return bucket.tensors() if isinstance(bucket, FlatBucket) else list(bucket)


def unique_names(named: list) -> list:
    """The names of [(name, tensor)], in order; a name sent twice in one payload is an error."""
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tensor names in one payload: {sorted({n for n in names if names.count(n) > 1})}")
    return names


def encode_tensors(named: list) -> str:
    """[(name, tensor)] -> base64 safetensors with the send order in the metadata (no pickle anywhere)."""
    return base64.b64encode(encode_blob(named, unique_names(named))).decode()


def encode_blob(named: list, names: list | None = None) -> bytes:
    """[(name, tensor)] -> safetensors bytes (CPU copies), the send order in the metadata."""
    names = names or [n for n, _ in named]
    return safetensors.torch.save({n: t.detach().cpu().contiguous() for n, t in named},
                                  metadata={"order": json.dumps(names)})


# handle -> [(name, tensor)], filled by `hand_over` and emptied by `take_over` in the same process
_HANDED: dict[str, list] = {}
_HANDED_LOCK = threading.Lock()


def hand_over(named: list) -> str:
    """Park [(name, tensor)] for an in-process server; -> the handle its request names (used once)."""
    unique_names(named)
    handle = uuid.uuid4().hex
    with _HANDED_LOCK:
        _HANDED[handle] = list(named)
    return handle


def take_over(handle) -> list:
    """The tensors parked under `handle` (removed); a handle this process never parked names the likely cause."""
    with _HANDED_LOCK:
        named = _HANDED.pop(handle, None) if isinstance(handle, str) else None
    if named is None:
        raise ValueError(f"no in-process payload under handle {str(handle)[:40]!r}: load_format={LOCAL_FORMAT!r} "
                         f"works only for a server in the trainer's own process, once per handle (send "
                         f"load_format={SAFE_FORMAT!r} to a server in another process)")
    return named


def drop_handed(handle: str) -> None:
    """Forget a handle a failed request left parked (its tensors are freed with it); a taken one is a no-op."""
    with _HANDED_LOCK:
        _HANDED.pop(handle, None)


def decode_tensors(payload: str) -> list:
    """Inverse of `encode_tensors`; any malformed input raises ValueError naming what is wrong."""
    try:
        blob = base64.b64decode(payload, validate=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"tensor payload is not base64: {e}") from e
    return decode_blob(blob)


def _unique_keys(pairs) -> dict:
    names = [k for k, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate keys in the safetensors header: {sorted({k for k in names if names.count(k) > 1})}")
    return dict(pairs)


def decode_blob(blob: bytes) -> list:
    """safetensors bytes -> [(name, tensor)] in the sender's order."""
    if len(blob) < 8:
        raise ValueError(f"tensor payload of {len(blob)} bytes is too short for safetensors")
    (hlen,) = struct.unpack("<Q", blob[:8])
    if hlen > len(blob) - 8:
        raise ValueError("tensor payload is not safetensors (looks like a pickle or is truncated); the embedded "
                         f"server accepts load_format={SAFE_FORMAT!r} only and never unpickles")
    try:   # a key named twice would let the header say one thing and the data another: refused
        header = json.loads(blob[8:8 + hlen], object_pairs_hook=_unique_keys)
        tensors = safetensors.torch.load(blob)
        order = json.loads(header.get("__metadata__", {}).get("order", "null")) or sorted(tensors)
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"tensor payload is not valid safetensors: {e}") from e
    if sorted(order) != sorted(tensors):
        raise ValueError(f"payload order metadata lists {len(order)} names for {len(tensors)} tensors")
    return [(n, tensors[n]) for n in order]


def served_storage(model, mcfg) -> dict:
    """{name: bf16} for the trainable fp32 parameters an FP8 push sends in bf16 (the release's storage of the
    norms, head and compressors, `buckets.served_dtype`). The servers run those bf16 values; a trainer that kept
    fp32 values would score, and step, a policy they do not serve -- and an update smaller than half a bf16 step
    (2^-9 of a norm weight near 1: ~80 steps at lr 5e-5, thousands at 1e-6) would never reach them. With this
    map the optimizer keeps the weights at their bf16 values and the fp32 sum of the updates in its master."""
    return {n: torch.bfloat16 for n, p in model.named_parameters()   # (expert stacks are FP8-served)
            if p.requires_grad and p.dtype == torch.float32 and getattr(p, "expert_ids", None) is None
            and not sglang_fp8(n, mcfg) and served_dtype(n, p, mcfg) == torch.bfloat16}


def optimizer_storage(cfg, mcfg):
    """What a run's trainer holds its weights in (`Trainer(served_storage=)`): with an FP8 push and
    `optim.round_to_served`, `served_storage`'s map; else None (the trainer's own dtypes)."""
    if cfg.optim.round_to_served and cfg.rollout.weights == "fp8":
        return lambda model: served_storage(model, mcfg)
    return None
