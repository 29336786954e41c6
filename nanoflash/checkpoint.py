"""Read and write DeepSeek-V4 checkpoints in the official Hugging Face layout, one tensor at a time.

Layout (deepseek-ai/DeepSeek-V4-Flash): `config.json`, `model.safetensors.index.json` ({"weight_map": name ->
shard file}) and shards `model-0000k-of-0000n.safetensors`. Names are the official ones, which are also the
nanoflash FQNs (the table lives in `names.py`). Storage per tensor (v4_notes §3.2-3.3):

    FP8   W[i,j] = e4m3(Q[i,j]) * S[i//128, j//128]       attention / shared-expert / indexer wq_b / MTP linears
    FP4   W[i,j] = e2m1(nibble(i,j)) * S[i, j//32]         routed experts; int8 bytes hold 2 values (low nibble first)
    BF16 / F32 / I64                                      norms, embed/head, compressors / mHC, sinks, ape, bias / tid2eid

with the scale S a sibling tensor `<module>.scale` (F8_E8M0, 2^(b-127)) or, as SGLang/Miles write it,
`<module>.weight_scale_inv` (F32). The model always holds dequantized weights; quantization happens here.

`load_hf_checkpoint(model, path)` walks the tensors the given model holds (a full model, one pipeline stage,
or an EP rank with some experts: the names say which), reads each one with `safe_open` (memory-mapped, so
only that tensor is copied), dequantizes into the parameter's own dtype and copies it in place. A meta-built
model is materialized first (`to_empty`, then every tensor is overwritten). "Unexpected" means a name that
maps to no tensor of the FULL model described by `cfg` (nor is the scale of one); tensors of layers or
experts this model does not hold are simply not read. Every defect raises one `CheckpointError` naming the
tensor and the file: missing or unexpected tensor, wrong shape or dtype, missing or non-finite scale,
truncated/corrupt shard, index naming a file that is not there, an index whose `weight_map` is no name -> file
map. Every header is checked against the config before a meta-built model takes any memory (`check_headers`).
Integrity: safetensors has no checksum, so a bit flipped inside a tensor's bytes loads as it is (a NaN/inf that
results is refused; a finite wrong value is not detectable here). A nanoflash training checkpoint (DCP,
`parallel/dcp.py`) carries a CRC per file and is verified; an HF checkpoint is trusted as its files are.

`save_hf_checkpoint(model, path, weights, experts)` writes the same layout: weights="fp8", experts="fp4" is
the official release; experts="fp8" the re-pack SGLang serves on Hopper (Miles sets SGLANG_DSV4_FP4_EXPERTS=0);
weights="bf16" a plain BF16 checkpoint (exact round trip for bf16 models). `wo_a` follows the release and is
stored FP8: the official converter and SGLang (with SGLANG_OPT_FP8_WO_A_GEMM=0) dequantize it to BF16 when
they load it, so one file serves both. FP8 experts are quantized straight from the model's weights rather than
through FP4 (`quant.fp4_to_fp8`), which only loses less.

`repack_release_fp8_experts(src, dst)` turns the official release (FP4 experts) into that FP8-expert re-pack,
shard by shard, each converted expert checked exact (`python -m nanoflash.export --from-release SRC DST`).

Differences from production loaders: no tensor-parallel slicing (nanoflash has no TP), no fused or
permuted in-memory layouts (SGLang's `wkv_gate`, its `ape` hotfix), plain fp32 dequantization on the CPU.

Tests: `pytest tests/test_checkpoint.py -q`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanoflash import quant
from nanoflash.names import (  # noqa: F401  (re-exported: the name table's public API)
    HFName, checkpoint_keys, hf_state_dict_to_nanoflash, hf_to_official, nanoflash_state_dict_to_hf,
    official_inventory, official_to_hf, release_kind, scale_shape, storage_kind)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 2**30  # the release's shards are ~3.5 GB each; 5 GiB keeps files mmap-friendly
FLOAT_DTYPES = ("BF16", "F16", "F32")
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
# On-disk dtypes accepted for each release kind (a BF16 export, or the FP8-expert re-pack, loads too).
ALLOWED = {"fp8": ("F8_E4M3",) + FLOAT_DTYPES, "fp4": ("I8", "U8", "F8_E4M3") + FLOAT_DTYPES,
           "bf16": FLOAT_DTYPES, "fp32": FLOAT_DTYPES, "int64": ("I64", "I32")}


class CheckpointError(ValueError):
    """A malformed checkpoint; the message names the tensor and the file."""


# ---------------------------------------------------------------------------- index
def read_weight_map(path: str) -> dict[str, str]:
    """name -> absolute shard path, from the index (or a lone `model.safetensors`); every file must exist."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read the index {index}: {e!r}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"the index {index}: weight_map must map tensor names to shard files, got "
                                  f"{type(weight_map).__name__} {str(weight_map)[:80]}")
    elif os.path.exists(os.path.join(path, SINGLE_FILE)):
        with _open_shard(os.path.join(path, SINGLE_FILE)) as f:
            weight_map = {k: SINGLE_FILE for k in f.keys()}
    else:
        raise CheckpointError(f"{path} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    out = {name: os.path.join(path, file) for name, file in weight_map.items()}
    for name, file in out.items():
        if not os.path.isfile(file):
            raise CheckpointError(f"the index {index} puts tensor {name!r} in {file}, which does not exist")
    return out


@contextlib.contextmanager
def _open_shard(file: str):
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError for truncated/corrupt headers
        raise CheckpointError(f"cannot open shard {file} (truncated or corrupt?): {e}") from e
    with handle as f:
        yield f


def _scale_name(name: str, weight_map: dict) -> str | None:
    """The scale sibling of `<module>.weight` present in the checkpoint: `.scale` or `.weight_scale_inv`."""
    stem = name[: -len(".weight")]
    found = [stem + s for s in _SCALE_SUFFIXES if stem + s in weight_map]
    return found[0] if found else None


def check_unexpected(weight_map: dict, cfg) -> None:
    """Raise on a checkpoint name that is no tensor (or scale of a tensor) of the full model `cfg` describes."""
    inventory = official_inventory(cfg)
    for name, file in weight_map.items():
        base = name
        for suffix in _SCALE_SUFFIXES:
            if name.endswith(suffix):
                base = name[: -len(suffix)] + ".weight"
        if base not in inventory:
            raise CheckpointError(f"unexpected tensor {name!r} in {file}: no such tensor in the model described "
                                  f"by the config (n_layers={cfg.n_layers}, n_routed_experts={cfg.n_routed_experts})")


# ---------------------------------------------------------------------------- reading one tensor
class _Shards:
    """Lazily opened shard handles (memory-mapped; nothing is read until a tensor is asked for)."""

    def __init__(self, stack: contextlib.ExitStack):
        self.stack, self.handles = stack, {}

    def get(self, file: str):
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(_open_shard(file))
        return self.handles[file]

    def header(self, name: str, file: str) -> tuple[str, tuple]:
        """(safetensors dtype string, shape) from the shard header; no tensor bytes are read."""
        try:
            sl = self.get(file).get_slice(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"tensor {name!r} is listed for {file} but not stored there: {e}") from e
        return sl.get_dtype(), tuple(sl.get_shape())

    def read(self, name: str, file: str, want_shape: tuple, want_dtypes: tuple | None = None) -> torch.Tensor:
        """One tensor, after checking its header dtype and shape (before any bytes are copied)."""
        dtype, shape = self.header(name, file)
        if want_dtypes is not None and dtype not in want_dtypes:
            raise CheckpointError(f"tensor {name!r} in {file} has dtype {dtype}; expected one of {want_dtypes}")
        if shape != tuple(want_shape):
            raise CheckpointError(f"tensor {name!r} in {file} has shape {list(shape)}; expected {list(want_shape)}")
        try:
            return self.get(file).get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {file} (corrupt shard?): {e}") from e


def _read_scale(shards, name, weight_map, kind, shape) -> torch.Tensor:
    sname = _scale_name(name, weight_map)
    if sname is None:
        raise CheckpointError(f"tensor {name!r} in {weight_map[name]} is stored {kind} but has no "
                              f"'.scale' / '.weight_scale_inv' sibling")
    dtypes = ("F8_E8M0",) if kind == "fp4" else ("F8_E8M0", "F32")
    s = shards.read(sname, weight_map[sname], scale_shape(kind, shape), dtypes)
    decoded = quant.e8m0_decode(s) if s.dtype != torch.float32 else s
    if not (torch.isfinite(decoded).all() and (decoded > 0).all()):
        bad = (~torch.isfinite(decoded) | (decoded <= 0)).nonzero()[0].tolist()
        raise CheckpointError(f"scale {sname!r} in {weight_map[sname]} is NaN/inf/non-positive at {bad}")
    return s


def read_tensor(shards, name: str, weight_map: dict, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Read `name` whatever its storage (fp8 / packed fp4 / float / int) and return it as `dtype` [shape]."""
    kind, file = release_kind(name), weight_map[name]
    stored = shards.header(name, file)[0]
    if stored not in ALLOWED[kind]:
        raise CheckpointError(f"tensor {name!r} in {file} has dtype {stored}; a {kind} tensor is stored as one "
                              f"of {ALLOWED[kind]}")
    if stored == "F8_E4M3":
        q = shards.read(name, file, shape)
        return quant.dequantize_fp8_block(q, _read_scale(shards, name, weight_map, "fp8", shape), dtype)
    if stored in ("I8", "U8") and kind == "fp4":
        packed = shards.read(name, file, (shape[0], shape[1] // 2)).view(torch.int8)  # 2 values per byte
        return quant.dequantize_fp4(packed, _read_scale(shards, name, weight_map, "fp4", shape), dtype)
    if name.endswith(".weight") and _scale_name(name, weight_map):
        raise CheckpointError(f"tensor {name!r} in {file} is stored {stored} but has a scale sibling "
                              f"{_scale_name(name, weight_map)!r}: only F8_E4M3 and packed FP4 tensors carry one")
    return shards.read(name, file, shape).to(dtype)


def check_headers(shards, model, weight_map: dict) -> None:
    """Every tensor the model holds against its shard's header (a dtype its kind allows, the stored shape the
    config implies) before the model takes any memory: a checkpoint that contradicts its config.json fails
    here, not after 284B parameters were allocated."""
    for name, dst in model.state_dict(keep_vars=True).items():
        kind, file = release_kind(name), weight_map[name]
        stored, got = shards.header(name, file)
        if stored not in ALLOWED[kind]:
            raise CheckpointError(f"tensor {name!r} in {file} has dtype {stored}; a {kind} tensor is stored as "
                                  f"one of {ALLOWED[kind]}")
        want = tuple(dst.shape)
        want = (want[0], want[1] // 2) if stored in ("I8", "U8") and kind == "fp4" else want
        if got != want:
            raise CheckpointError(f"tensor {name!r} in {file} has shape {list(got)}; expected {list(want)} (its "
                                  f"config's)")


# ---------------------------------------------------------------------------- load
def _materialize(model: torch.nn.Module, device) -> None:
    """A meta-built model gets real (uninitialized) storage; loading then overwrites every tensor.

    A non-persistent meta buffer (not in the checkpoint) would stay garbage, so it is refused up front.
    """
    if not any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        return
    saved = set(model.state_dict())
    lost = [n for n, b in model.named_buffers() if b.is_meta and n not in saved]
    if lost:
        raise RuntimeError(f"cannot materialize a meta model with non-persistent buffers {lost[:5]}: "
                           f"they are not in a checkpoint; build them on a real device")
    model.to_empty(device=device)


def _plan(model, weight_map: dict, cfg, path: str) -> dict[str, dict[str, torch.Tensor]]:
    """shard file -> {name: destination tensor} for every tensor the model holds; missing ones raise."""
    inventory = official_inventory(cfg)
    plan = {}
    for name, dst in model.state_dict(keep_vars=True).items():
        if name not in inventory:
            raise CheckpointError(f"the model holds {name!r}, which is no tensor of the DeepSeek-V4 model "
                                  f"described by its config; cannot load it from {path}")
        if tuple(dst.shape) != tuple(inventory[name]):
            raise CheckpointError(f"the model's {name!r} has shape {list(dst.shape)}, the config implies "
                                  f"{list(inventory[name])}")
        if name not in weight_map:
            raise CheckpointError(f"missing tensor {name!r}: not in the checkpoint index of {path}")
        plan.setdefault(weight_map[name], {})[name] = dst
    return plan


@torch.no_grad()
def load_hf_checkpoint(model: torch.nn.Module, path: str, cfg=None, device="cpu") -> dict:
    """Load the tensors `model` holds from the checkpoint directory `path`; returns {"loaded", "skipped", "files"}.

    The model may be partial (a pipeline stage, an EP rank's experts) and may live on the meta device.
    Each tensor is dequantized into the destination's dtype; tid2eid keeps its integer dtype.
    """
    cfg = cfg if cfg is not None else model.cfg
    weight_map = read_weight_map(path)
    check_unexpected(weight_map, cfg)
    _plan(model, weight_map, cfg, path)   # names and shapes against the config, before any memory is taken
    with contextlib.ExitStack() as stack:
        shards = _Shards(stack)
        check_headers(shards, model, weight_map)   # and against the shards' headers (no tensor bytes read)
        _materialize(model, device)
        plan = _plan(model, weight_map, cfg, path)
        for file in sorted(plan):
            for name, dst in plan[file].items():
                t = read_tensor(shards, name, weight_map, tuple(dst.shape), dst.dtype)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise CheckpointError(f"{name} in {os.path.join(path, file)} holds NaN/inf values")
                dst.copy_(t)
    loaded = sum(len(v) for v in plan.values())
    n_weights = sum(1 for n in weight_map if not n.endswith(_SCALE_SUFFIXES))
    return {"loaded": loaded, "skipped": n_weights - loaded, "files": len(plan)}


# ---------------------------------------------------------------------------- save
def _stored_tensors(name: str, t: torch.Tensor, weights: str, experts: str, scale_fmt: str):
    """The (name, tensor) pairs that store model tensor `t`: itself in bf16/fp32/int64, or (Q, scale)."""
    kind = release_kind(name)
    fmt = {"fp8": weights, "fp4": experts}.get(kind, kind)
    if fmt == "int64":
        return [(name, t.to(torch.int64))]
    if fmt == "fp32":
        return [(name, t.to(torch.float32))]
    if fmt == "bf16":
        return [(name, t.to(torch.bfloat16))]
    stem = name[: -len(".weight")]
    if fmt == "fp4":
        q, s = quant.quantize_fp4(t)
        return [(name, q), (stem + ".scale", s)]
    q, s = quant.quantize_fp8_block(t, fmt=scale_fmt)
    return [(name, q), (stem + (".scale" if scale_fmt == "ue8m0" else ".weight_scale_inv"), s)]


def _release_config(cfg, weights: str, experts: str, scale_fmt: str) -> dict:
    """config.json: the HF keys of `cfg`, with the storage fields saying how this checkpoint was written."""
    d = dataclasses.replace(cfg, dtype=weights, expert_dtype=experts, scale_fmt=scale_fmt).to_hf_dict()
    if "fp8" in (weights, experts):
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]}
        if scale_fmt == "ue8m0":
            d["quantization_config"]["scale_fmt"] = "ue8m0"
    return d


@torch.no_grad()
def save_hf_checkpoint(model: torch.nn.Module, path: str, weights: str = "bf16", experts: str | None = None,
                       scale_fmt: str = "ue8m0", shard_bytes: int = DEFAULT_SHARD_BYTES, cfg=None) -> dict:
    """Write `model`'s tensors as `path/{model-0000k-of-0000n.safetensors, index, config.json}`.

    weights: storage of the release's FP8 linears, "fp8" | "bf16". experts: routed experts, "fp4" | "fp8" |
    "bf16" (default: "fp4" when weights="fp8", else "bf16"). scale_fmt: FP8 scales as "ue8m0" (`.scale`,
    F8_E8M0, the release) or "fp32" (`.weight_scale_inv`, Miles' Hopper push); FP4 scales are always E8M0.
    A partial model writes only its own tensors. Returns the index dict.
    """
    cfg = cfg if cfg is not None else model.cfg
    experts = experts or ("fp4" if weights == "fp8" else "bf16")
    if weights not in ("fp8", "bf16") or experts not in ("fp4", "fp8", "bf16") or scale_fmt not in ("ue8m0", "fp32"):
        raise ValueError(f"save_hf_checkpoint: weights={weights!r} (fp8|bf16), experts={experts!r} "
                         f"(fp4|fp8|bf16), scale_fmt={scale_fmt!r} (ue8m0|fp32)")
    os.makedirs(path, exist_ok=True)
    order = {n: i for i, n in enumerate(official_inventory(cfg))}
    sd = model.state_dict()
    unknown = [n for n in sd if n not in order]
    if unknown:
        raise CheckpointError(f"the model holds tensors that are not in the DeepSeek-V4 inventory: {unknown[:5]}")
    shards, current, size = [], {}, 0
    for name in sorted(sd, key=order.__getitem__):
        for sname, t in _stored_tensors(name, sd[name].detach().cpu(), weights, experts, scale_fmt):
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > shard_bytes:
                shards.append(_write_shard(path, len(shards), current))
                current, size = {}, 0
            current[sname], size = t.contiguous(), size + nbytes
    if current or not shards:
        shards.append(_write_shard(path, len(shards), current))
    return _finish(path, shards, _release_config(cfg, weights, experts, scale_fmt))


def _write_shard(path: str, k: int, tensors: dict) -> tuple[str, list[str], int]:
    """Write one shard under a temporary name; `_finish` renames it once the shard count is known."""
    tmp = os.path.join(path, f".shard-{k:05d}.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    return tmp, list(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def _finish(path: str, shards: list, config: dict) -> dict:
    n, weight_map, total = len(shards), {}, 0
    for k, (tmp, names, nbytes) in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        os.replace(tmp, os.path.join(path, file))
        weight_map.update({name: file for name in names})
        total += nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return index


# ---------------------------------------------------------------------------- release -> FP8 experts
def _fp4_expert(name: str, stored: str) -> bool:
    """Is `name` a routed expert's packed FP4 weight (the one kind the re-pack changes)?"""
    if not name.endswith(".weight") or stored not in ("I8", "U8"):
        return False
    try:
        return release_kind(name) == "fp4"
    except KeyError:   # a name outside the table (none in the release) is copied as it is
        return False


def _fp8_expert_config(path: str) -> dict:
    """The release's config.json with the experts' storage said FP8 (the `nanoflash` block and a top-level
    `expert_dtype`, where present); its FP8 `quantization_config` is what SGLang reads and stays as it is."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    if "quantization_config" not in hf:
        raise CheckpointError(f"{path}/config.json has no quantization_config: not an FP8/FP4 release")
    if "expert_dtype" in hf:
        hf["expert_dtype"] = "fp8"
    if isinstance(hf.get("nanoflash"), dict):
        hf["nanoflash"]["expert_dtype"] = "fp8"
    return hf


@torch.no_grad()
def repack_release_fp8_experts(src: str, dst: str) -> dict:
    """The official release (packed FP4 routed experts) -> the same checkpoint with FP8 experts, the layout SGLang
    serves them from on Hopper (SGLANG_DSV4_FP4_EXPERTS=0; the official `convert.py --expert-dtype fp8`).

    One source shard at a time (its tensors, then its output shard; never more than one shard in memory): every
    routed-expert weight stored as packed FP4 (I8/U8 + an E8M0 1x32 `.scale`) becomes F8_E4M3 + an E8M0 128x128
    `.scale` (`quant.fp4_to_fp8`), in the shard that held the weight, and is checked exact: its dequantized
    values must equal the FP4 ones (a tile whose scales span more than 2^14 would not be; CheckpointError names
    it). Every other tensor is copied as it is. config.json: the release's, experts said FP8 (`_fp8_expert_config`);
    other files (tokenizer, ...) are copied. Returns {"shards", "converted", "copied"}."""
    weight_map, config = read_weight_map(src), _fp8_expert_config(src)
    os.makedirs(dst, exist_ok=True)
    by_file: dict[str, list] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    converted, copied, shards = 0, 0, []
    with contextlib.ExitStack() as stack:
        cache = _Shards(stack)   # memory-mapped shards: headers first, then one tensor at a time
        fp4 = {n for n, file in weight_map.items() if _fp4_expert(n, cache.header(n, file)[0])}
        old_scales = {n[: -len("weight")] + "scale" for n in fp4}   # replaced, written beside their weights
        for k, file in enumerate(sorted(by_file)):
            out = {}
            for name in sorted(by_file[file]):
                if name in old_scales:
                    continue
                if name not in fp4:
                    out[name] = cache.get(file).get_tensor(name)
                    copied += 1
                    continue
                sname = name[: -len("weight")] + "scale"
                if sname not in weight_map:
                    raise CheckpointError(f"FP4 expert {name!r} in {file} has no '.scale' sibling")
                packed = cache.get(file).get_tensor(name).view(torch.int8)
                s32 = cache.get(weight_map[sname]).get_tensor(sname)
                q, s = quant.fp4_to_fp8(packed, s32)
                if not torch.equal(quant.dequantize_fp8_block(q, s, torch.float32),
                                   quant.dequantize_fp4(packed, s32, torch.float32)):
                    raise CheckpointError(f"{name} in {file}: FP4 -> FP8 is not exact (a 128x128 tile's FP4 scales "
                                          f"span more than 2^14); it cannot be re-packed losslessly")
                out[name], out[sname] = q, s
                converted += 1
            shards.append(_write_shard(dst, k, out))
            del out
    for f in os.listdir(src):
        full = os.path.join(src, f)
        if os.path.isfile(full) and not f.endswith(".safetensors") and f not in (INDEX_FILE, "config.json"):
            shutil.copyfile(full, os.path.join(dst, f))
    _finish(dst, shards, config)
    return {"shards": len(shards), "converted": converted, "copied": copied}
