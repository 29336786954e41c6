"""Tests for the checkpoint name table (`nanoflash/names.py`) and HF safetensors I/O
(`nanoflash/checkpoint.py`). Run: `pytest tests/test_checkpoint.py -q` (about 15 s on 2 cores)."""
import json
import math
import os
from collections import Counter

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanoflash import quant
from nanoflash.checkpoint import (INDEX_FILE, CheckpointError, HFName, checkpoint_keys, hf_state_dict_to_nanoflash,
                                  hf_to_official, load_hf_checkpoint, nanoflash_state_dict_to_hf,
                                  official_inventory, official_to_hf, save_hf_checkpoint, storage_kind)
from nanoflash.config import preset
from nanoflash.model import Transformer

# v4_notes §3.1/§3.4: the released DeepSeek-V4-Flash holds 69,187 tensors with this dtype census, and its shapes
# add up to 290,942,289,362 parameters (tid2eid is a buffer, not counted there).
FLASH_TENSORS = 69187
FLASH_CENSUS = {"F8_E4M3": 375, "F32": 417, "BF16": 433, "I64": 3, "I8": 33792, "F8_E8M0": 34167}
FLASH_PARAMS = 290_942_289_362
KIND_TO_DTYPE = {"fp8": "F8_E4M3", "fp4": "I8", "bf16": "BF16", "fp32": "F32", "int64": "I64", "e8m0": "F8_E8M0"}
# Format error bounds, per element, with s the block's dequant scale (from the checkpoint itself):
# e4m3 keeps 3 mantissa bits (half-ulp 2^-4 relative); its subnormal grid step is 2^-9 s (half: 2^-10 s).
FP8_REL, FP8_ABS = 2.0**-4, 2.0**-10
# e2m1 grid {0,.5,1,1.5,2,3,4,6}: half-steps are 0.25 below 2 and <= 0.25|v| above, in units of s.
FP4_REL, FP4_ABS = 0.25, 0.25


# ---------------------------------------------------------------------------- helpers
def tiny_model(seed=0, **overrides):
    return Transformer(preset("tiny", **overrides)).init_weights(seed)


def read_dir(path):
    """All tensors of a checkpoint directory (tiny sizes only)."""
    out = {}
    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def write_dir(path, tensors):
    """One shard + index: the minimal official layout, for hand-corrupted checkpoints."""
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model-00001-of-00001.safetensors"))
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors}}, f)


def meta_model(cfg):
    with torch.device("meta"):
        return Transformer(cfg)


def spec_flash_keys():
    """The release's key list written out from the v4_notes §3.2 tables, independently of names."""
    def q(*names):  # FP8/FP4 weights: the weight and its `.scale`
        return [n for name in names for n in (name + ".weight", name + ".scale")]
    keys = ["embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"]
    ratios = [0, 0] + [4, 128] * 20 + [4, 0]
    for prefix, lid in [(f"layers.{i}.", i) for i in range(43)] + [("mtp.0.", 43)]:
        blk = ["attn_norm.weight", "ffn_norm.weight", "attn.attn_sink", "attn.q_norm.weight", "attn.kv_norm.weight",
               "ffn.gate.weight", "ffn.gate.tid2eid" if lid < 3 else "ffn.gate.bias"]
        blk += [f"hc_{a}_{b}" for a in ("attn", "ffn") for b in ("fn", "base", "scale")]
        blk += q("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b")
        blk += q(*[f"ffn.shared_experts.w{j}" for j in (1, 2, 3)])
        blk += q(*[f"ffn.experts.{e}.w{j}" for e in range(256) for j in (1, 2, 3)])
        if ratios[lid]:
            blk += ["attn.compressor." + n for n in ("wkv.weight", "wgate.weight", "ape", "norm.weight")]
        if ratios[lid] == 4:
            blk += q("attn.indexer.wq_b") + ["attn.indexer.weights_proj.weight"]
            blk += ["attn.indexer.compressor." + n for n in ("wkv.weight", "wgate.weight", "ape", "norm.weight")]
        if prefix == "mtp.0.":
            blk += q("e_proj", "h_proj") + ["enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn",
                                            "hc_head_base", "hc_head_scale"]
        keys += [prefix + k for k in blk]
    return keys


# ---------------------------------------------------------------------------- name table
def test_flash_inventory_matches_release_census():
    cfg = preset("flash")
    keys = checkpoint_keys(cfg)
    assert len(keys) == FLASH_TENSORS, len(keys)
    assert sorted(keys) == sorted(spec_flash_keys())
    census = Counter(KIND_TO_DTYPE[storage_kind(k, cfg)] for k in keys)
    assert dict(census) == FLASH_CENSUS, census
    inv = official_inventory(cfg)
    n_params = sum(math.prod(s) for k, s in inv.items() if not k.endswith("tid2eid"))
    assert n_params == FLASH_PARAMS, n_params


def test_flash_names_round_trip_through_transformers_names():
    cfg = preset("flash")
    names = [k for k in checkpoint_keys(cfg) if storage_kind(k, cfg) != "e8m0"]
    hf = [official_to_hf(n) for n in names]
    assert [hf_to_official(h) for h in hf] == names
    assert len(set(hf)) == len(names)  # the (name, expert, half) slots are distinct
    assert official_to_hf("layers.3.ffn.experts.7.w3.weight") == HFName("model.layers.3.mlp.experts.gate_up_proj", 7, 1)
    assert official_to_hf("layers.3.ffn.experts.7.w2.weight") == HFName("model.layers.3.mlp.experts.down_proj", 7)
    assert official_to_hf("layers.2.attn.indexer.compressor.ape").name == \
        "model.layers.2.self_attn.compressor.indexer.position_bias"
    assert official_to_hf("hc_head_fn").name == "model.hc_head.hc_fn"
    assert official_to_hf("mtp.0.ffn.experts.3.w1.weight").name == "mtp.0.ffn.experts.3.w1.weight"


def test_storage_kind_follows_release_fields():
    cfg = preset("flash")
    assert [storage_kind(n, cfg) for n in ("layers.0.attn.wo_a.weight", "layers.5.ffn.experts.0.w2.weight",
                                           "layers.2.attn.compressor.wkv.weight", "layers.0.ffn.gate.tid2eid",
                                           "layers.9.ffn.gate.bias", "layers.0.attn.wq_a.scale")] == \
        ["fp8", "fp4", "bf16", "int64", "fp32", "e8m0"]
    repack = preset("flash", expert_dtype="fp8")
    assert storage_kind("layers.5.ffn.experts.0.w2.weight", repack) == "fp8"
    with pytest.raises(KeyError, match="not a DeepSeek-V4 checkpoint name"):
        storage_kind("layers.0.attn.wq.weight", cfg)
    with pytest.raises(KeyError, match="merged expert tensor"):
        hf_to_official("model.layers.0.mlp.experts.gate_up_proj")


def test_tiny_model_state_dict_is_the_inventory():
    cfg = preset("tiny")
    sd = Transformer(cfg).state_dict()
    inv = official_inventory(cfg)
    assert {k: tuple(v.shape) for k, v in sd.items()} == inv


def test_flash_layer_kinds_on_meta_are_the_inventory():
    """The default-suite version of the slow test below: flash at its real widths and 256 experts, cut to 4
    layers that hold every layer kind (sliding + hash, C4 + hash, C128 + score routing) and the MTP layer."""
    cfg = preset("flash", n_layers=4, compress_ratios=(0, 0, 4, 128, 0))
    assert cfg.n_hash_layers == 3 and cfg.n_mtp_layers == 1
    with torch.device("meta"):
        sd = Transformer(cfg).state_dict()
    inv = official_inventory(cfg)
    assert {k: tuple(v.shape) for k, v in sd.items()} == inv
    assert "layers.2.attn.indexer.wq_b.weight" in inv and "layers.3.ffn.gate.bias" in inv \
        and "layers.2.ffn.gate.tid2eid" in inv and "mtp.0.ffn.experts.255.w2.weight" in inv


@pytest.mark.slow  # ~11 s: builds the 35,020-tensor flash model on meta
def test_flash_meta_model_state_dict_is_the_inventory():
    cfg = preset("flash")
    with torch.device("meta"):
        sd = Transformer(cfg).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == official_inventory(cfg)


def test_names_and_merge_agree_with_transformers(tmp_path):
    """transformers itself is the oracle: its model's keys/shapes, and from_pretrained on our BF16 export."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV4ForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    m = tiny_model(compress_ratios=(0, 4, 128, 4, 0))  # transformers knows ratios 4 and 128 only
    cfg = m.cfg
    main = {k: v for k, v in m.state_dict().items() if not k.startswith("mtp.")}
    save_hf_checkpoint(m, str(tmp_path), weights="bf16")
    hf = DeepseekV4ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    hsd = hf.state_dict()
    ours = nanoflash_state_dict_to_hf(main, cfg)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in hsd.items()}
    for k, v in ours.items():  # what transformers loaded == our merge of the same tensors, as stored
        kind = storage_kind(hf_to_official(HFName(k, 0, 0)), cfg)
        want = v.to(torch.bfloat16).float() if kind in ("bf16", "fp8", "fp4") else v
        assert torch.equal(hsd[k].to(want.dtype), want), k
    back = hf_state_dict_to_nanoflash(ours, cfg)
    assert all(torch.equal(back[k], main[k]) for k in main) and set(back) == set(main)


# ---------------------------------------------------------------------------- save -> load
def test_bf16_round_trip_is_exact(tmp_path):
    m = tiny_model()
    idx = save_hf_checkpoint(m, str(tmp_path), weights="bf16", shard_bytes=100_000)
    assert len(set(idx["weight_map"].values())) > 1  # really sharded
    m2 = meta_model(m.cfg)
    report = load_hf_checkpoint(m2, str(tmp_path))
    sd, sd2 = m.state_dict(), m2.state_dict()
    assert report["loaded"] == len(sd) and report["skipped"] == 0
    for k, v in sd.items():
        kind = storage_kind(k, m.cfg)
        want = v.to(torch.bfloat16).to(v.dtype) if kind in ("bf16", "fp8", "fp4") else v  # fp32/int64 stay
        assert sd2[k].dtype == v.dtype and torch.equal(sd2[k], want), k
    bf = tiny_model().to(torch.bfloat16)  # an all-bf16 model round-trips bit for bit
    save_hf_checkpoint(bf, str(tmp_path / "bf"), weights="bf16")
    bf2 = tiny_model(seed=1).to(torch.bfloat16)
    load_hf_checkpoint(bf2, str(tmp_path / "bf"))
    assert all(torch.equal(a, b) for a, b in zip(bf.state_dict().values(), bf2.state_dict().values()))
    cfg_json = json.load(open(tmp_path / "config.json"))
    assert cfg_json["num_hidden_layers"] == 4 and "quantization_config" not in cfg_json


def expected_scale(w, kind, fmt):
    """The scale grid the release format prescribes, by a loop over blocks of the original weight:
    FP8 128x128 blocks, FP4 1x32 blocks; ue8m0 S = 2^ceil(log2(amax * fp32(1/qmax))), fp32 S = amax / 448."""
    bm, bn, qmax = (1, 32, 6.0) if kind == "fp4" else (128, 128, 448.0)
    rows, cols = -(-w.shape[0] // bm), -(-w.shape[1] // bn)
    out = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            amax = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].abs().max().float()
            if fmt == "fp32":
                out[i, j] = amax / qmax
            else:
                r = (amax * torch.tensor(1.0 / qmax, dtype=torch.float32)).item()   # fp32 product, as the spec
                out[i, j] = 2.0 ** math.ceil(math.log2(r))
    return out


@pytest.mark.parametrize("experts,scale_fmt", [("fp4", "ue8m0"), ("fp8", "ue8m0"), ("fp8", "fp32")])
def test_quantized_round_trip_within_format_error(tmp_path, experts, scale_fmt):
    m = tiny_model()
    save_hf_checkpoint(m, str(tmp_path), weights="fp8", experts=experts, scale_fmt=scale_fmt)
    stored = read_dir(str(tmp_path))
    m2 = meta_model(m.cfg)
    load_hf_checkpoint(m2, str(tmp_path))
    sd, sd2 = m.state_dict(), m2.state_dict()
    n_quant = 0
    for k, w in sd.items():
        kind = storage_kind(k, preset("tiny", expert_dtype=experts))
        if kind not in ("fp8", "fp4"):
            continue
        n_quant += 1
        sname = k[: -len("weight")] + ("scale" if scale_fmt == "ue8m0" or kind == "fp4" else "weight_scale_inv")
        s = stored[sname]
        s = quant.e8m0_decode(s) if s.dtype != torch.float32 else s
        # The bound uses the scale computed from the original weights' block amax, never the stored one (an
        # oversized stored scale would loosen its own bound); the stored scale must equal it exactly.
        want_s = expected_scale(w.float(), kind, "ue8m0" if kind == "fp4" else scale_fmt)
        assert torch.equal(s.float(), want_s), (k, "stored scale is not the block amax rule")
        if kind == "fp4":
            s_el = want_s.repeat_interleave(32, 1)[:, : w.shape[1]]  # naive: scale of element (i, j) = S[i, j//32]
            bound = FP4_REL * w.abs() + FP4_ABS * s_el
            assert stored[k].dtype == torch.int8 and stored[k].shape[1] * 2 == w.shape[1], k
        else:
            s_el = want_s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
            bound = FP8_REL * w.abs() + FP8_ABS * s_el
            assert stored[k].dtype == torch.float8_e4m3fn, k
        err = (sd2[k].float() - w.float()).abs()
        assert (err <= bound).all(), (k, (err - bound).max().item())
    assert n_quant == sum(storage_kind(k, m.cfg) in ("fp8", "fp4") for k in sd)
    assert stored["layers.0.attn.wo_a.weight"].dtype == torch.float8_e4m3fn  # wo_a is FP8, as in the release
    assert torch.equal(sd2["layers.0.ffn.gate.tid2eid"], sd["layers.0.ffn.gate.tid2eid"])
    assert json.load(open(tmp_path / "config.json"))["quantization_config"]["weight_block_size"] == [128, 128]


def test_partial_model_reads_only_its_tensors(tmp_path):
    m = tiny_model()
    save_hf_checkpoint(m, str(tmp_path), weights="fp8", shard_bytes=20_000)
    full = meta_model(m.cfg)
    load_hf_checkpoint(full, str(tmp_path))
    part = tiny_model(seed=3)
    for lid in ("0", "1"):  # a later pipeline stage ...
        del part.layers[lid]
    part.embed = None
    part.layers["2"].ffn.experts.keep(range(4, 8))  # ... on an EP rank holding experts 4..7
    held = set(part.state_dict())
    weight_map = json.load(open(tmp_path / INDEX_FILE))["weight_map"]
    owner = {}
    for n, f in weight_map.items():
        owner.setdefault(f, set()).add(n.replace(".scale", ".weight"))
    foreign = [f for f, names in owner.items() if not names & held]
    assert foreign, "the test needs a shard holding none of the partial model's tensors"
    for f in foreign:  # those shards are never opened: garbage there must not matter
        (tmp_path / f).write_bytes(b"not a safetensors file")
    report = load_hf_checkpoint(part, str(tmp_path))
    assert report["loaded"] == len(held) and report["skipped"] == len(full.state_dict()) - len(held)
    ref = full.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in part.state_dict().items())
    with pytest.raises(CheckpointError, match="cannot open shard"):  # a full load does need them
        load_hf_checkpoint(meta_model(m.cfg), str(tmp_path))


# ---------------------------------------------------------------------------- malformed checkpoints
@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A tiny checkpoint in the official FP8 + FP4 layout, as a dict of tensors."""
    m = tiny_model()
    d = tmp_path_factory.mktemp("release")
    save_hf_checkpoint(m, str(d), weights="fp8", experts="fp4")
    return m.cfg, read_dir(str(d))


def corrupt_load(tmp_path, cfg, tensors, pattern):
    write_dir(str(tmp_path), tensors)
    with pytest.raises(CheckpointError, match=pattern):
        load_hf_checkpoint(meta_model(cfg), str(tmp_path))


def test_clean_copy_loads(tmp_path, release):
    cfg, tensors = release
    write_dir(str(tmp_path), tensors)
    assert load_hf_checkpoint(meta_model(cfg), str(tmp_path))["loaded"] == len(official_inventory(cfg))


def test_a_weight_map_that_is_no_map_is_named(tmp_path, release):
    """Issue 39 (low). Bug caught: an index whose weight_map is a list raised AttributeError ('list' object has
    no attribute 'items') instead of one CheckpointError naming the index."""
    cfg, tensors = release
    write_dir(str(tmp_path), tensors)
    index = tmp_path / INDEX_FILE
    index.write_text(json.dumps({"weight_map": sorted(json.loads(index.read_text())["weight_map"])}))
    with pytest.raises(CheckpointError, match=r"weight_map must map tensor names to shard files, got list"):
        load_hf_checkpoint(meta_model(cfg), str(tmp_path))


def test_a_checkpoint_contradicting_its_config_fails_before_the_model_takes_memory(tmp_path, release, monkeypatch):
    """Issue 39 (low). Bug caught: the model was materialised (`to_empty`: at flash scale ~0.5 TB allocated)
    before the checkpoint's tensors were compared with the shapes its config.json implies. Now every header is
    checked on the meta model first; the trainer leaves an HF start on meta for that (`build_model`)."""
    import dataclasses
    from nanoflash.cli import parse_args
    from nanoflash.parallel.dims import ParallelDims
    from nanoflash.rl.trainer import Trainer
    cfg, tensors = release
    write_dir(str(tmp_path), tensors)
    wider = dataclasses.replace(cfg, moe_inter_dim=2 * cfg.moe_inter_dim)     # what a wrong config.json says
    model = meta_model(wider)
    with pytest.raises(CheckpointError, match=r"w1\.weight' in .* shape \[32, 32\]; expected \[64, 32\]"):
        load_hf_checkpoint(model, str(tmp_path))
    assert all(p.is_meta for p in model.parameters())                         # nothing was allocated
    calls = []
    monkeypatch.setattr(Transformer, "to_empty", lambda self, **kw: calls.append(kw))
    with pytest.raises(CheckpointError, match="expected"):
        Trainer(parse_args(["--recipe", "smoke", "--train.checkpoint", str(tmp_path)]), wider, ParallelDims(),
                str(tmp_path))
    assert calls == []


def test_missing_tensor(tmp_path, release):
    cfg, tensors = release
    t = dict(tensors)
    del t["layers.3.attn.wkv.weight"]
    corrupt_load(tmp_path, cfg, t, r"missing tensor 'layers\.3\.attn\.wkv\.weight'")


def test_missing_scale(tmp_path, release):
    cfg, tensors = release
    t = dict(tensors)
    del t["layers.3.ffn.experts.5.w2.scale"]
    corrupt_load(tmp_path, cfg, t, r"'layers\.3\.ffn\.experts\.5\.w2\.weight' in .* no '\.scale'")


def test_unexpected_tensor(tmp_path, release):
    cfg, tensors = release
    t = dict(tensors, **{"layers.2.ffn.experts.8.w1.weight": torch.zeros(2)})  # tiny has experts 0..7
    corrupt_load(tmp_path, cfg, t, r"unexpected tensor 'layers\.2\.ffn\.experts\.8\.w1\.weight' in .*model-00001")


def test_wrong_shape(tmp_path, release):
    cfg, tensors = release
    t = dict(tensors)
    t["layers.1.attn.wq_b.weight"] = t["layers.1.attn.wq_b.weight"][:-1]
    corrupt_load(tmp_path, cfg, t, r"'layers\.1\.attn\.wq_b\.weight' in .* shape \[127, 32\]; expected \[128, 32\]")


def test_wrong_dtype(tmp_path, release):
    cfg, tensors = release
    t = dict(tensors)
    t["layers.0.attn_norm.weight"] = t["layers.0.attn_norm.weight"].to(torch.float8_e4m3fn)
    corrupt_load(tmp_path, cfg, t, r"'layers\.0\.attn_norm\.weight' in .* dtype F8_E4M3")
    t = dict(tensors)
    t["layers.0.ffn.gate.tid2eid"] = t["layers.0.ffn.gate.tid2eid"].float()
    corrupt_load(tmp_path / "b", cfg, t, r"'layers\.0\.ffn\.gate\.tid2eid' in .* dtype F32")


@pytest.mark.parametrize("name", ["layers.2.attn.wq_a.scale", "layers.3.ffn.experts.1.w1.scale"])
def test_nan_scale(tmp_path, release, name):
    cfg, tensors = release
    t = dict(tensors)
    s = t[name].view(torch.uint8).clone()
    s[0, 0] = 255  # E8M0 byte 255 is NaN
    t[name] = s.view(torch.float8_e8m0fnu)
    corrupt_load(tmp_path, cfg, t, rf"scale '{name}' in .* NaN")


def test_fp32_weight_scale_inv_accepted_and_checked(tmp_path, release):
    cfg, tensors = release
    t = dict(tensors)
    name = "layers.1.attn.wo_b"
    t[name + ".weight_scale_inv"] = quant.e8m0_decode(t.pop(name + ".scale"))
    write_dir(str(tmp_path / "ok"), t)
    m = meta_model(cfg)
    load_hf_checkpoint(m, str(tmp_path / "ok"))
    want = quant.dequantize_fp8_block(tensors[name + ".weight"], tensors[name + ".scale"], torch.float32)
    assert torch.equal(m.state_dict()[name + ".weight"], want)
    t[name + ".weight_scale_inv"][0, 0] = float("inf")
    corrupt_load(tmp_path / "bad", cfg, t, r"scale 'layers\.1\.attn\.wo_b\.weight_scale_inv' in .* NaN/inf")


def test_truncated_shard(tmp_path):
    m = tiny_model()
    save_hf_checkpoint(m, str(tmp_path), weights="fp8", shard_bytes=50_000)
    file = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[1]
    data = (tmp_path / file).read_bytes()
    (tmp_path / file).write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"cannot open shard .*{file}"):
        load_hf_checkpoint(meta_model(m.cfg), str(tmp_path))


def test_index_points_to_missing_file(tmp_path, release):
    cfg, tensors = release
    write_dir(str(tmp_path), tensors)
    index = json.load(open(tmp_path / INDEX_FILE))
    index["weight_map"]["layers.0.attn.wq_a.weight"] = "model-00002-of-00002.safetensors"
    json.dump(index, open(tmp_path / INDEX_FILE, "w"))
    corrupt_load_dir = pytest.raises(CheckpointError, match=r"'layers\.0\.attn\.wq_a\.weight' in .*model-00002")
    with corrupt_load_dir:
        load_hf_checkpoint(meta_model(cfg), str(tmp_path))
